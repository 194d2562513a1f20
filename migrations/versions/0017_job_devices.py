"""devices: the device each job's shards need (any, cpu, cuda); workers claim only shards of jobs
on their device or any

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-06
"""
from alembic import op
import sqlalchemy as sa

revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('device', sa.String(16), nullable=False, server_default='any'))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('device')
