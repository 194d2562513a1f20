"""job retries: a job's lineage (retry_of) and the records a retry job plans (retry_records)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01
"""
from alembic import op
import sqlalchemy as sa

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('retry_of', sa.String(length=40), nullable=True))
        batch_op.create_index('ix_jobs_retry_of', ['retry_of'])
    op.create_table(
        'retry_records',
        sa.Column('job_id', sa.String(length=40), sa.ForeignKey('jobs.id'), nullable=False),
        sa.Column('source', sa.Text(), nullable=False),
        sa.Column('ordinal', sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint('job_id', 'source', 'ordinal'),
    )


def downgrade() -> None:
    op.drop_table('retry_records')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index('ix_jobs_retry_of')
        batch_op.drop_column('retry_of')
