"""initial ledger

Revision ID: 0001
Revises:
Create Date: 2026-11-29 11:44:31.880984
"""
from alembic import op
import sqlalchemy as sa


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('bundles',
    sa.Column('digest', sa.String(length=71), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('uri', sa.Text(), nullable=False),
    sa.Column('task', sa.String(length=32), nullable=False),
    sa.Column('family', sa.String(length=32), nullable=False),
    sa.Column('meta', sa.Text(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('digest')
    )
    with op.batch_alter_table('bundles', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_bundles_name'), ['name'], unique=False)

    op.create_table('schedules',
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('tenant', sa.String(length=100), nullable=False),
    sa.Column('cron', sa.String(length=100), nullable=False),
    sa.Column('timezone', sa.String(length=64), nullable=False),
    sa.Column('template', sa.Text(), nullable=False),
    sa.Column('catchup', sa.Boolean(), nullable=False),
    sa.Column('paused', sa.Boolean(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('name')
    )
    op.create_table('bundle_aliases',
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('alias', sa.String(length=200), nullable=False),
    sa.Column('digest', sa.String(length=71), nullable=False),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['digest'], ['bundles.digest'], ),
    sa.PrimaryKeyConstraint('name', 'alias')
    )
    op.create_table('jobs',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('tenant', sa.String(length=100), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('idempotency_key', sa.String(length=300), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('task', sa.String(length=32), nullable=False),
    sa.Column('manifest', sa.Text(), nullable=False),
    sa.Column('bundle_ref', sa.String(length=300), nullable=False),
    sa.Column('bundle_digest', sa.String(length=71), nullable=False),
    sa.Column('input_uri', sa.Text(), nullable=False),
    sa.Column('output_uri', sa.Text(), nullable=False),
    sa.Column('work_uri', sa.Text(), nullable=False),
    sa.Column('priority', sa.Integer(), nullable=False),
    sa.Column('deadline_at', sa.Float(), nullable=True),
    sa.Column('schedule', sa.String(length=200), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('plan', sa.Text(), nullable=True),
    sa.Column('records_total', sa.BigInteger(), nullable=True),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.Column('started_at', sa.Float(), nullable=True),
    sa.Column('finished_at', sa.Float(), nullable=True),
    sa.Column('plan_seconds', sa.Float(), nullable=True),
    sa.Column('verify_seconds', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['bundle_digest'], ['bundles.digest'], ),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('tenant', 'idempotency_key', name='uq_jobs_tenant_idempotency')
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index('ix_jobs_status', ['status'], unique=False)

    op.create_table('job_events',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=40), nullable=False),
    sa.Column('shard_id', sa.String(length=40), nullable=True),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('from_status', sa.String(length=16), nullable=True),
    sa.Column('to_status', sa.String(length=16), nullable=True),
    sa.Column('detail', sa.Text(), nullable=True),
    sa.Column('at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('job_events', schema=None) as batch_op:
        batch_op.create_index('ix_job_events_job', ['job_id', 'id'], unique=False)

    op.create_table('job_inputs',
    sa.Column('job_id', sa.String(length=40), nullable=False),
    sa.Column('idx', sa.Integer(), nullable=False),
    sa.Column('uri', sa.Text(), nullable=False),
    sa.Column('size', sa.BigInteger(), nullable=False),
    sa.Column('etag', sa.String(length=200), nullable=False),
    sa.Column('version_id', sa.String(length=300), nullable=True),
    sa.Column('records', sa.BigInteger(), nullable=True),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ),
    sa.PrimaryKeyConstraint('job_id', 'idx')
    )
    op.create_table('shards',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('job_id', sa.String(length=40), nullable=False),
    sa.Column('bucket', sa.Integer(), nullable=False),
    sa.Column('ordinal', sa.Integer(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('num_records', sa.Integer(), nullable=False),
    sa.Column('num_tokens', sa.BigInteger(), nullable=False),
    sa.Column('input_uri', sa.Text(), nullable=False),
    sa.Column('lease_owner', sa.String(length=200), nullable=True),
    sa.Column('lease_expires_at', sa.Float(), nullable=True),
    sa.Column('not_before', sa.Float(), nullable=True),
    sa.Column('output_uri', sa.Text(), nullable=True),
    sa.Column('output_sha256', sa.String(length=64), nullable=True),
    sa.Column('output_rows', sa.Integer(), nullable=True),
    sa.Column('errors_uri', sa.Text(), nullable=True),
    sa.Column('errors_sha256', sa.String(length=64), nullable=True),
    sa.Column('error_rows', sa.Integer(), nullable=True),
    sa.Column('tokens_input', sa.BigInteger(), nullable=True),
    sa.Column('tokens_output', sa.BigInteger(), nullable=True),
    sa.Column('tokens_real', sa.BigInteger(), nullable=True),
    sa.Column('tokens_padded', sa.BigInteger(), nullable=True),
    sa.Column('execute_seconds', sa.Float(), nullable=True),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('job_id', 'bucket', 'ordinal', name='uq_shards_job_bucket_ordinal')
    )
    with op.batch_alter_table('shards', schema=None) as batch_op:
        batch_op.create_index('ix_shards_job_status', ['job_id', 'status'], unique=False)

    op.create_table('attempts',
    sa.Column('shard_id', sa.String(length=40), nullable=False),
    sa.Column('number', sa.Integer(), nullable=False),
    sa.Column('worker', sa.String(length=200), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('started_at', sa.Float(), nullable=False),
    sa.Column('heartbeat_at', sa.Float(), nullable=True),
    sa.Column('finished_at', sa.Float(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['shard_id'], ['shards.id'], ),
    sa.PrimaryKeyConstraint('shard_id', 'number')
    )
    op.create_table('record_errors',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=40), nullable=False),
    sa.Column('shard_id', sa.String(length=40), nullable=False),
    sa.Column('record_id', sa.Text(), nullable=True),
    sa.Column('source', sa.Text(), nullable=False),
    sa.Column('ordinal', sa.BigInteger(), nullable=False),
    sa.Column('error', sa.String(length=64), nullable=False),
    sa.Column('message', sa.Text(), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ),
    sa.ForeignKeyConstraint(['shard_id'], ['shards.id'], ),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('record_errors', schema=None) as batch_op:
        batch_op.create_index('ix_record_errors_job', ['job_id', 'id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('record_errors', schema=None) as batch_op:
        batch_op.drop_index('ix_record_errors_job')

    op.drop_table('record_errors')
    op.drop_table('attempts')
    with op.batch_alter_table('shards', schema=None) as batch_op:
        batch_op.drop_index('ix_shards_job_status')

    op.drop_table('shards')
    op.drop_table('job_inputs')
    with op.batch_alter_table('job_events', schema=None) as batch_op:
        batch_op.drop_index('ix_job_events_job')

    op.drop_table('job_events')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index('ix_jobs_status')

    op.drop_table('jobs')
    op.drop_table('bundle_aliases')
    op.drop_table('schedules')
    with op.batch_alter_table('bundles', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_bundles_name'))

    op.drop_table('bundles')
