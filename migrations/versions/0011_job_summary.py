"""job summaries: what a published job's task says about its results (label counts, a score
histogram), as in its _MANIFEST.json, kept for the status object and the REST API

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01
"""
from alembic import op
import sqlalchemy as sa

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('summary', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('summary')
