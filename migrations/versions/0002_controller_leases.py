"""controller leases on jobs, dispatch times on shards and planning tasks

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""
from alembic import op
import sqlalchemy as sa

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('lock_owner', sa.String(length=200), nullable=True))
        batch_op.add_column(sa.Column('lock_expires_at', sa.Float(), nullable=True))
    with op.batch_alter_table('shards', schema=None) as batch_op:
        batch_op.add_column(sa.Column('dispatched_at', sa.Float(), nullable=True))
    with op.batch_alter_table('job_inputs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('dispatched_at', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('job_inputs', schema=None) as batch_op:
        batch_op.drop_column('dispatched_at')
    with op.batch_alter_table('shards', schema=None) as batch_op:
        batch_op.drop_column('dispatched_at')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('lock_expires_at')
        batch_op.drop_column('lock_owner')
