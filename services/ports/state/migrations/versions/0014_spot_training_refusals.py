"""``runs.spot_training_refusals``: the spot zones where a run gave up waiting for a training
node, each with when (``{"": at}`` for a run that lists no zone), in place of the one time
``spot_training_refused_at``.

Revision ID: 0014
Revises: 0013
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("spot_training_refusals", sa.JSON(), nullable=True))
    runs = sa.table(
        "runs",
        sa.column("id", sa.String),
        sa.column("spot_training_refused_at", sa.Float),
        sa.column("spot_training_refusals", sa.JSON),
    )
    conn = op.get_bind()
    refused = conn.execute(
        sa.select(runs.c.id, runs.c.spot_training_refused_at).where(runs.c.spot_training_refused_at.is_not(None))
    ).all()
    for run_id, at in refused:
        conn.execute(runs.update().where(runs.c.id == run_id).values(spot_training_refusals={"": at}))
    op.drop_column("runs", "spot_training_refused_at")
