"""The error taxonomy of the controllers (after kopf's): errors rise to ``Scheduler.tick``, which
retries a temporary one after a delay and fails the run on a permanent one. Anything else is
unexpected: logged once and retried next tick."""


class PermanentError(Exception):
    """Retrying cannot help (bad input, missing artefact): the run is failed with this message."""


class TemporaryError(Exception):
    """Retrying later can help (capacity, a service not up yet): the run is retried after ``delay``
    seconds, doubling while it keeps failing, and ``reason`` is shown on the run meanwhile."""

    def __init__(self, reason: str, delay: float = 5.0) -> None:
        super().__init__(reason)
        self.reason = reason
        self.delay = delay
