"""The error taxonomy of the controllers: temporary errors are retried next tick, permanent ones fail the run."""


class PermanentError(Exception):
    """Retrying cannot help (bad input, missing artefact): the run is failed with this message."""
