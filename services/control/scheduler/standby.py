"""The standby pod's command: hold the training node warm, doing nothing, until stopped.

``python -m services.control.scheduler.standby``; it exits 0 on SIGTERM (the launcher's stop), so the
pod ends Succeeded. See ``services.control.scheduler.plan``'s docstring for why it exists.
"""

from __future__ import annotations

import signal
import sys


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
