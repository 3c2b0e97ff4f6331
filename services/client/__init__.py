"""The client of a remote spotrl API: ``spotrl runs ...`` from a laptop, as ``kubectl`` or
``sky jobs`` talk to their servers.

Torch-free by contract (pyproject.toml): a laptop installs the package but never imports the
trainer. ``api`` is the HTTP client and where its server and token come from, ``view`` the
tables people read (shared with ``spotrl demo``), ``commands`` the typer commands.
"""
