"""API tokens (hashed) per tenant; schedule runs, one per schedule and logical date

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""
import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'api_tokens',
        sa.Column('id', sa.String(length=40), primary_key=True),
        sa.Column('tenant', sa.String(length=100), nullable=False),
        sa.Column('name', sa.String(length=200), nullable=True),
        sa.Column('token_sha256', sa.String(length=64), nullable=False),
        sa.Column('created_at', sa.Float(), nullable=False),
        sa.Column('last_used_at', sa.Float(), nullable=True),
        sa.Column('revoked_at', sa.Float(), nullable=True),
        sa.UniqueConstraint('token_sha256', name='uq_api_tokens_sha256'),
    )
    op.create_index('ix_api_tokens_tenant', 'api_tokens', ['tenant'])
    op.create_table(
        'schedule_runs',
        sa.Column('schedule', sa.String(length=200), sa.ForeignKey('schedules.name'), primary_key=True),
        sa.Column('ds', sa.String(length=10), primary_key=True),
        sa.Column('job_id', sa.String(length=40), sa.ForeignKey('jobs.id'), nullable=False),
        sa.Column('created_at', sa.Float(), nullable=False),
    )
    with op.batch_alter_table('schedules', schema=None) as batch_op:
        batch_op.add_column(sa.Column('start_at', sa.Float(), nullable=True))
    op.create_index('ix_jobs_tenant_created', 'jobs', ['tenant', 'created_at'])


def downgrade() -> None:
    op.drop_index('ix_jobs_tenant_created', table_name='jobs')
    with op.batch_alter_table('schedules', schema=None) as batch_op:
        batch_op.drop_column('start_at')
    op.drop_table('schedule_runs')
    op.drop_index('ix_api_tokens_tenant', table_name='api_tokens')
    op.drop_table('api_tokens')
