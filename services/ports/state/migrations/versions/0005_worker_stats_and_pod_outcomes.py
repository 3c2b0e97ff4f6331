"""``worker_stats`` (rollout workers' counters, exported by the API's /metrics) and
``ledger.outcome``; entries closed before it keep no outcome.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "worker_stats",
        sa.Column("run_id", sa.String(40), sa.ForeignKey("runs.id"), primary_key=True),
        sa.Column("worker", sa.String(128), primary_key=True),
        sa.Column("samples_produced", sa.Integer(), nullable=False),
        sa.Column("generation_seconds", sa.Float(), nullable=False),
        sa.Column("reward_cache_hits", sa.Integer(), nullable=False),
        sa.Column("reward_cache_misses", sa.Integer(), nullable=False),
        sa.Column("reward_cache_errors", sa.Integer(), nullable=False),
        sa.Column("reported_at", sa.Float(), nullable=False),
    )
    op.add_column("ledger", sa.Column("outcome", sa.String(16), nullable=True))
