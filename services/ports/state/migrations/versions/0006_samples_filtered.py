"""``runs.samples_filtered``: dynamic sampling's drops, counted apart from the queued samples'.
Runs before it counted them in ``samples_dropped`` until they ended (then lost them): 0.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "runs",
        sa.Column("samples_filtered", sa.Integer(), nullable=False, server_default="0"),
    )
