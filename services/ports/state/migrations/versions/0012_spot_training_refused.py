"""``runs.spot_training_refused_at``: when an ``auto`` run last gave up waiting for a spot training node.

Revision ID: 0012
Revises: 0011
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("spot_training_refused_at", sa.Float(), nullable=True))
