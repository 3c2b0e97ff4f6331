"""``worker_stats.generation_batch``: the most sequences a rollout worker's engine generated at
once in its latest batch.

Revision ID: 0015
Revises: 0014
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("worker_stats", sa.Column("generation_batch", sa.Integer(), nullable=True))
