"""``python -m services``: the ``spotrl`` command line."""

from services.cli.main import app

app()
