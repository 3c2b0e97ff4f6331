"""What the ``spotrl`` command's modules share: the ``--home`` option, the settings it selects and
the log setup of a long-running command (``services.cli.main`` and the modules beside it)."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from services.core.config import Settings

HomeOption = Annotated[
    Path | None, typer.Option("--home", help="State directory of the embedded backends [env SPOTRL_HOME].")
]


def load_settings(home: Path | None) -> Settings:
    """The server's settings, with ``home`` (``--home``) as SPOTRL_HOME when given."""
    from services.core.config import Settings

    if home is not None:
        os.environ["SPOTRL_HOME"] = str(home)
    return Settings()


def start_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # `kill -USR1 <pid>` prints every thread's stack to the log: what a process that seems stuck is
    # doing. The process's own stderr: sys.stderr may be a stand-in without a file (run in-process).
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
