"""The ``tracking_cursors`` table: what each experiment tracker has of each run.

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tracking_cursors",
        sa.Column("run_id", sa.String(40), sa.ForeignKey("runs.id"), primary_key=True),
        sa.Column("sink", sa.String(32), primary_key=True),
        sa.Column("iteration", sa.Integer(), nullable=False),
        sa.Column("eval_version", sa.Integer(), nullable=False),
        sa.Column("ended", sa.Boolean(), nullable=False),
    )
