"""Indexes of ``runs`` in the list's order, ``(created_at, id)``, and per tenant: a page of the
list reads its own runs only, not every run sorted.

Revision ID: 0013
Revises: 0012
"""

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_runs_created_at_id", "runs", ["created_at", "id"])
    op.create_index("ix_runs_tenant_created_at_id", "runs", ["tenant", "created_at", "id"])
