"""job counters as columns: failed attempts (the retry budget) and consecutive step failures

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""
from alembic import op
import sqlalchemy as sa

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('failed_attempts', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('step_failures', sa.Integer(), nullable=False, server_default='0'))
    # the retry budget used to be counted from the audit log: carry those counts over
    op.execute("UPDATE jobs SET failed_attempts = (SELECT count(*) FROM job_events e WHERE e.job_id = jobs.id "
               "AND e.kind = 'attempt' AND e.to_status = 'failed')")


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('step_failures')
        batch_op.drop_column('failed_attempts')
