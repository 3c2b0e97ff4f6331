"""The initial schema: runs, their iterations and the cost ledger.

Frozen as the first release created it: later changes are later revisions, never edits here.
``runs.cancel_requested`` is the stopping flag that revision 0002 turns into statuses.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("name", sa.String(64), nullable=True),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("status_reason", sa.String(500), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=True),
        sa.Column("ended_at", sa.Float(), nullable=True),
        sa.Column("policy_version", sa.Integer(), nullable=False),
        sa.Column("iterations_done", sa.Integer(), nullable=False),
        sa.Column("prompts_published", sa.Integer(), nullable=False),
        sa.Column("samples_produced", sa.Integer(), nullable=False),
        sa.Column("samples_trained", sa.Integer(), nullable=False),
        sa.Column("samples_dropped", sa.Integer(), nullable=False),
        sa.Column("last_mean_reward", sa.Float(), nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("ending_status", sa.String(16), nullable=True),
        sa.Column("ending_reason", sa.String(500), nullable=True),
        sa.Column("train_failures", sa.Integer(), nullable=False),
        sa.Column("next_train_at", sa.Float(), nullable=False),
        sa.Column("worker_slots_used", sa.Integer(), nullable=False),
        sa.Column("train_launch_committed", sa.Integer(), nullable=False),
    )
    op.create_index("ix_runs_status", "runs", ["status"])
    op.create_table(
        "iterations",
        sa.Column("run_id", sa.String(40), sa.ForeignKey("runs.id"), primary_key=True),
        sa.Column("iteration", sa.Integer(), primary_key=True),
        sa.Column("policy_version", sa.Integer(), nullable=False),
        sa.Column("mean_reward", sa.Float(), nullable=False),
        sa.Column("kl", sa.Float(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("samples_trained", sa.Integer(), nullable=False),
        sa.Column("samples_dropped", sa.Integer(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("ended_at", sa.Float(), nullable=False),
    )
    op.create_table(
        "ledger",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(40), sa.ForeignKey("runs.id"), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("pod", sa.String(128), nullable=False),
        sa.Column("instance_type", sa.String(64), nullable=False),
        sa.Column("capacity_type", sa.String(16), nullable=False),
        sa.Column("price_per_hour", sa.Float(), nullable=False),
        sa.Column("price_source", sa.String(300), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("ended_at", sa.Float(), nullable=True),
    )
    op.create_index("ix_ledger_run_id", "ledger", ["run_id"])
    op.create_index("ix_ledger_pod", "ledger", ["pod"])
