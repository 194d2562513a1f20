"""steps: the denoising steps (x images) of a shard, reported by its running attempt's heartbeats
and set to its records' planned steps when it commits (generate_image progress at step granularity)

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-06
"""
from alembic import op
import sqlalchemy as sa

revision = '0018'
down_revision = '0017'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # a plain ADD COLUMN on SQLite too: recreating `shards` would drop its tally triggers (0014)
    op.add_column('shards', sa.Column('progress_steps', sa.BigInteger(), nullable=False, server_default='0'))


def downgrade() -> None:
    op.drop_column('shards', 'progress_steps')     # SQLite 3.35+ drops in place, its triggers kept
