"""worker liveness: the host (failure domain) of each attempt, and whether it was running its
shard's records when it ended (a lost attempt counts toward quarantine only then)

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-02
"""
from alembic import op
import sqlalchemy as sa

revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.add_column(sa.Column('host', sa.String(200), nullable=True))
        batch_op.add_column(sa.Column('computing_at', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.drop_column('computing_at')
        batch_op.drop_column('host')
