"""scale: jobs held after a dry run's planning (`batchinf plan`: jobs.hold, status planned); the
shards' dispatch-order index (job, status, bucket desc, ordinal)

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01
"""
from alembic import op
import sqlalchemy as sa

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('hold', sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.add_column(sa.Column('error_records', sa.BigInteger(), nullable=False, server_default='0'))
    op.execute("UPDATE jobs SET error_records = (SELECT COALESCE(SUM(CASE WHEN s.bucket < 0 THEN s.num_records "
               "ELSE COALESCE(s.error_rows, 0) END), 0) FROM shards s WHERE s.job_id = jobs.id "
               "AND (s.parent_id IS NULL OR s.bucket >= 0))")
    op.create_index('ix_shards_dispatch_order', 'shards', ['job_id', 'status', sa.text('bucket DESC'), 'ordinal'])


def downgrade() -> None:
    op.drop_index('ix_shards_dispatch_order', table_name='shards')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('error_records')
        batch_op.drop_column('hold')
