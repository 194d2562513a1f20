"""records done within a running shard, reported by its heartbeats (generate progress)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""
from alembic import op
import sqlalchemy as sa

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('shards', schema=None) as batch_op:
        batch_op.add_column(sa.Column('progress_records', sa.Integer(), nullable=False, server_default='0'))


def downgrade() -> None:
    with op.batch_alter_table('shards', schema=None) as batch_op:
        batch_op.drop_column('progress_records')
