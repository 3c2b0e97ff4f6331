"""``runs.tenant`` (existing runs belong to the default tenant), ``runs.prompt_count``,
``runs.reward_failures`` and ``runs.last_reward_error``.

The server defaults fill the rows that exist; new rows get the model's defaults.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # The default tenant's name as it was then (services.ports.state.state_schema.DEFAULT_TENANT).
    op.add_column(
        "runs",
        sa.Column("tenant", sa.String(64), nullable=False, server_default="default"),
    )
    op.create_index("ix_runs_tenant", "runs", ["tenant"])
    op.add_column(
        "runs",
        sa.Column("prompt_count", sa.Integer(), nullable=False, server_default="0"),
    )
    op.add_column(
        "runs",
        sa.Column("reward_failures", sa.Integer(), nullable=False, server_default="0"),
    )
    op.add_column("runs", sa.Column("last_reward_error", sa.String(500), nullable=True))
