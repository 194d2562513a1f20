"""tenant storage grants and limits; jobs remember whether they run confined

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30
"""
from alembic import op
import sqlalchemy as sa

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'tenant_grants',
        sa.Column('tenant', sa.String(length=100), nullable=False),
        sa.Column('prefix', sa.Text(), nullable=False),
        sa.Column('mode', sa.String(length=8), nullable=False),
        sa.Column('created_at', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('tenant', 'prefix', 'mode'),
    )
    op.create_table(
        'tenant_limits',
        sa.Column('tenant', sa.String(length=100), nullable=False),
        sa.Column('name', sa.String(length=64), nullable=False),
        sa.Column('value', sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint('tenant', 'name'),
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('confined', sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('confined')
    op.drop_table('tenant_limits')
    op.drop_table('tenant_grants')
