"""dynamic splitting: when the lifecycle asked a running shard's attempt to split

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01
"""
from alembic import op
import sqlalchemy as sa

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('shards', schema=None) as batch_op:
        batch_op.add_column(sa.Column('split_requested_at', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('shards', schema=None) as batch_op:
        batch_op.drop_column('split_requested_at')
