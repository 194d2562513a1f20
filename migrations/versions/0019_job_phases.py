"""phases: where a job's wall time goes. A job's marks (JSON: the creating process's start, the
time of each transition, its embedded workers' spawn, ready and loaded times, and once it ended
the phases computed from them), and the model load a committed attempt's worker paid

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-06
"""
from alembic import op
import sqlalchemy as sa

revision = '0019'
down_revision = '0018'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # plain ADD COLUMNs on SQLite too: recreating `attempts` would drop its tally trigger (0014)
    op.add_column('jobs', sa.Column('phases', sa.Text(), nullable=True))
    op.add_column('attempts', sa.Column('load_seconds', sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_column('attempts', 'load_seconds')     # SQLite 3.35+ drops in place, its triggers kept
    op.drop_column('jobs', 'phases')
