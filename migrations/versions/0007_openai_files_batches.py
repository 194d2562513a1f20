"""OpenAI-compatible files and batches: uploaded files (and batch output files), batches and their jobs

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""
from alembic import op
import sqlalchemy as sa

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'files',
        sa.Column('id', sa.String(40), primary_key=True),
        sa.Column('tenant', sa.String(100), nullable=False),
        sa.Column('filename', sa.String(300), nullable=False),
        sa.Column('purpose', sa.String(32), nullable=False),
        sa.Column('bytes', sa.BigInteger(), nullable=False),
        sa.Column('uri', sa.Text(), nullable=True),
        sa.Column('parts', sa.Text(), nullable=True),
        sa.Column('meta', sa.Text(), nullable=True),
        sa.Column('created_at', sa.Float(), nullable=False),
        sa.Column('deleted_at', sa.Float(), nullable=True),
    )
    op.create_index('ix_files_tenant_created', 'files', ['tenant', 'created_at'])
    op.create_table(
        'batches',
        sa.Column('id', sa.String(40), primary_key=True),
        sa.Column('tenant', sa.String(100), nullable=False),
        sa.Column('input_file_id', sa.String(40), nullable=False),
        sa.Column('endpoint', sa.String(64), nullable=False),
        sa.Column('completion_window', sa.String(32), nullable=False),
        sa.Column('model', sa.String(300), nullable=True),
        sa.Column('metadata', sa.Text(), nullable=True),
        sa.Column('job_id', sa.String(40), sa.ForeignKey('jobs.id'), nullable=True),
        sa.Column('errors', sa.Text(), nullable=True),
        sa.Column('output_file_id', sa.String(40), nullable=True),
        sa.Column('error_file_id', sa.String(40), nullable=True),
        sa.Column('created_at', sa.Float(), nullable=False),
        sa.Column('failed_at', sa.Float(), nullable=True),
        sa.Column('cancelling_at', sa.Float(), nullable=True),
        sa.Column('finalized_at', sa.Float(), nullable=True),
    )
    op.create_index('ix_batches_tenant_created', 'batches', ['tenant', 'created_at'])


def downgrade() -> None:
    op.drop_index('ix_batches_tenant_created', table_name='batches')
    op.drop_table('batches')
    op.drop_index('ix_files_tenant_created', table_name='files')
    op.drop_table('files')
