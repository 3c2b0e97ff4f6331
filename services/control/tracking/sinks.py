"""Which sinks a run gets: where its points go (TensorBoard, MLflow, Weights & Biases).

A run asks for trackers in its spec (``RunSpec.tracking``: which ones, the experiment or project
to log under); where they are and the credentials to reach them are the operator's
(``services.core.config.Settings``: ``SPOTRL_MLFLOW_TRACKING_URI``, ``SPOTRL_MLFLOW_TRACKING_TOKEN`` or
``SPOTRL_MLFLOW_TRACKING_TOKEN_FILE``, ``SPOTRL_WANDB_API_KEY`` or ``SPOTRL_WANDB_API_KEY_FILE``,
...). A ``*_FILE`` setting names a file holding the secret, such as a mounted Kubernetes Secret,
read when a sink is opened. No credential ever appears in an error message or a log line.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import SecretStr

from services.control.tracking.sink import Sink, TrackingError
from services.core.config import Settings
from services.ports.objects.object_store import ObjectStore

if TYPE_CHECKING:
    from services.domain.runspec import Tracking


def read_secret(value: SecretStr | None, file: Path | None, what: str) -> str | None:
    """The secret given as a value, else the content of ``file`` (stripped); None when neither."""
    if value is not None:
        return value.get_secret_value()
    if file is None:
        return None
    try:
        return file.read_text().strip() or None
    except OSError as e:
        raise TrackingError(f"cannot read the {what} file {file}: {e.strerror}") from None


def missing_settings(tracking: Tracking | None, settings: Settings) -> list[str]:
    """What the operator must set or install for the trackers a spec asks for (empty: nothing), so
    that such a run can be refused when it is submitted rather than have its figures go unsent."""
    if tracking is None:
        return []
    missing = []
    if tracking.mlflow is not None and not settings.mlflow_tracking_uri:
        missing.append("tracking.mlflow needs the operator's MLflow server (SPOTRL_MLFLOW_TRACKING_URI)")
    if (
        tracking.wandb is not None
        and settings.wandb_mode == "online"
        and settings.wandb_api_key is None
        and settings.wandb_api_key_file is None
    ):
        missing.append(
            "tracking.wandb needs the operator's W&B API key (SPOTRL_WANDB_API_KEY or SPOTRL_WANDB_API_KEY_FILE)"
        )
    if tracking.wandb is not None and importlib.util.find_spec("wandb") is None:  # looked up, not imported
        missing.append("tracking.wandb needs W&B's package beside the scheduler (pip install 'spotrl[wandb]')")
    return missing


class SinkSet:
    """The sinks of this process, opened on first use and shared by the runs that log to the same
    place: one object-store writer, one MLflow server connection, one W&B session (whose package is
    imported only when a run first asks for W&B: see ``services.control.tracking.wandb_sink``)."""

    def __init__(self, settings: Settings, objects: ObjectStore) -> None:
        self._settings = settings
        self._objects = objects
        self._sinks: dict[tuple[str, ...], Sink] = {}
        self._mlflow: Any = None  # mlflow_sink.MlflowServer once opened
        self._wandb: Any = None  # wandb_sink.WandbSession once opened

    def for_run(self, tracking: Tracking | None) -> list[Sink]:
        """The sinks a run's ``tracking`` section asks for; ``TrackingError`` if the operator has not
        configured one of them."""
        if tracking is None:
            return []
        missing = missing_settings(tracking, self._settings)
        if missing:
            raise TrackingError("; ".join(missing))
        wanted: list[tuple[str, ...]] = []
        if tracking.tensorboard:
            wanted.append(("tensorboard",))
        if tracking.mlflow is not None:
            wanted.append(("mlflow", tracking.mlflow.experiment))
        if tracking.wandb is not None:
            wanted.append(("wandb", tracking.wandb.project, tracking.wandb.entity or ""))
        for key in wanted:
            if key not in self._sinks:
                self._sinks[key] = self._make(*key)
        return [self._sinks[key] for key in wanted]

    def _make(self, name: str, *target: str) -> Sink:
        s = self._settings
        if name == "tensorboard":
            from services.control.tracking.tensorboard_sink import TensorBoardSink

            return TensorBoardSink(self._objects)
        if name == "mlflow":
            from services.control.tracking.mlflow_sink import MlflowServer, MlflowSink

            if self._mlflow is None:
                token = read_secret(s.mlflow_tracking_token, s.mlflow_tracking_token_file, "MLflow token")
                self._mlflow = MlflowServer(s.mlflow_tracking_uri or "", token=token)
            return MlflowSink(self._mlflow, experiment=target[0])
        from services.control.tracking.wandb_sink import WandbSession, WandbSink

        if self._wandb is None:
            key = read_secret(s.wandb_api_key, s.wandb_api_key_file, "W&B API key")
            self._wandb = WandbSession(
                s.resolved_wandb_dir(), mode=s.wandb_mode, api_key=key, base_url=s.wandb_base_url
            )
        return WandbSink(self._wandb, project=target[0], entity=target[1] or None)

    def close(self) -> None:
        """Close the MLflow connection and the W&B session (its open runs are marked preempted)."""
        self._sinks.clear()
        for held in (self._mlflow, self._wandb):
            if held is not None:
                held.close()
        self._mlflow = self._wandb = None
