"""scale: jobs held after a dry run's planning (`batchinf plan`: jobs.hold, status planned)

Revision ID: 0011_scale
Revises: 0010
Create Date: 2026-12-01
"""
from alembic import op
import sqlalchemy as sa

revision = '0011_scale'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('hold', sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('hold')
