"""The ``reward_failures`` table: a run's failed reward computations by reason. Runs before it
keep their total in ``runs.reward_failures`` only.

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "reward_failures",
        sa.Column("run_id", sa.String(40), sa.ForeignKey("runs.id"), primary_key=True),
        sa.Column("reason", sa.String(64), primary_key=True),
        sa.Column("count", sa.Integer(), nullable=False),
    )
