"""engines: the engine each job runs on (native, vllm, openai-http); workers claim only shards of
jobs on the engines they have

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-03
"""
from alembic import op
import sqlalchemy as sa

revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('engine', sa.String(32), nullable=False, server_default='native'))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('engine')
