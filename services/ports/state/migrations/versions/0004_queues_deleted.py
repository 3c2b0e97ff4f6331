"""``runs.queues_deleted``: runs ended before it keep their topics until the retention sweep.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "runs",
        sa.Column("queues_deleted", sa.Boolean(), nullable=False, server_default=sa.false()),
    )
