"""The scheduler's leader lease, ``runs.last_error``, and CANCELLING/ENDING as statuses.

Runs that were stopping under 0001 (status PENDING or RUNNING beside ``cancel_requested`` or
``ending_status``) get the stopping status, and the flag goes. SQLite drops the flag's column
in place (ALTER TABLE ... DROP COLUMN, SQLite 3.35+): a batch copy of ``runs`` would drop the
table that iterations and the ledger reference, which its enforced foreign keys refuse.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "leases",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("holder", sa.String(128), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
    )
    op.add_column("runs", sa.Column("last_error", sa.String(500), nullable=True))
    op.execute(
        "UPDATE runs SET"
        " status = CASE WHEN COALESCE(ending_status, 'CANCELLED') = 'CANCELLED' THEN 'CANCELLING' ELSE 'ENDING' END,"
        " ending_status = COALESCE(ending_status, 'CANCELLED'),"
        " ending_reason = COALESCE(ending_reason, 'cancelled by the user'),"
        " status_reason = COALESCE(ending_reason, 'cancelled by the user')"
        " WHERE status IN ('PENDING', 'RUNNING') AND (ending_status IS NOT NULL OR cancel_requested)"
    )
    op.drop_column("runs", "cancel_requested")
