"""planning attempts per input object: how many started, when the last one started, its error

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-10
"""
from alembic import op
import sqlalchemy as sa

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('job_inputs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('attempts', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('started_at', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('error', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('job_inputs', schema=None) as batch_op:
        batch_op.drop_column('error')
        batch_op.drop_column('started_at')
        batch_op.drop_column('attempts')
