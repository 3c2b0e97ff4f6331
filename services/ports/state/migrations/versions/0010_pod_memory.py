"""The ``pod_memory`` table: each pod's memory over time.

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "pod_memory",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(40), sa.ForeignKey("runs.id"), nullable=False),
        sa.Column("pod", sa.String(128), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("bytes", sa.Float(), nullable=False),
        sa.Column("peak_bytes", sa.Float(), nullable=False),
    )
    op.create_index("ix_pod_memory_run_id", "pod_memory", ["run_id"])
