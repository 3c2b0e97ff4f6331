"""Settings of every spotrl process, from ``SPOTRL_*`` environment variables.

The embedded default keeps all state under one home directory; pods started by the local
launcher inherit ``SPOTRL_HOME`` and so find the same queue, store and objects.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPOTRL_")

    home: Path = Field(default=Path(".spotrl"), description="Directory holding the embedded backends' state.")
    state_url: str | None = Field(
        default=None,
        repr=False,
        description="SQLAlchemy URL of the state store (postgresql+psycopg://...); default: SQLite in home.",
    )
    queue_url: str | None = Field(
        default=None, repr=False, description="kafka://host:9092[,host2:9092]; default: the SQLite queue in home."
    )
    reward_cache_url: str | None = Field(
        default=None, repr=False, description="redis://host:6379/0; default: the SQLite reward cache in home."
    )
    objects_url: str | None = Field(
        default=None,
        repr=False,
        description="s3://bucket/prefix (AWS settings from the environment); default: a directory in home.",
    )
    model_cache: Path | None = Field(
        default=None, description="Where converted base models are cached; default: home/models."
    )
    price_catalog: Path | None = Field(
        default=None,
        description="Price catalog file (the JSON of services/ports/prices/catalog.json) with the operator's own prices; default: the catalog shipped with spotrl.",
    )
    live_prices: bool = Field(
        default=False,
        description="Take AWS instances' spot prices from EC2's describe_spot_price_history (AWS credentials from the environment), falling back to the catalog's.",
    )
    live_prices_ttl_s: float = Field(
        default=300.0,
        gt=0,
        description="How long a live spot price (or a failure to get one) is reused before EC2 is asked again.",
    )
    tick_seconds: float = Field(default=0.5, gt=0, description="Scheduler reconcile interval.")
    lease_seconds: float = Field(
        default=10.0,
        gt=0,
        description="How long the leading scheduler's lease lasts unrenewed: a standby scheduler takes over this long after the leader dies. Several ticks long, so a slow tick does not lose it.",
    )
    session_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="A rollout worker that has not polled for this long (it polls between batches) loses its prompts to the others.",
    )
    stop_grace_s: float = Field(
        default=30.0, gt=0, description="Seconds a pod gets after SIGTERM before SIGKILL (a spot notice)."
    )
    tokens_file: Path | None = Field(
        default=None,
        description="The API's bearer tokens, stored hashed, each with its tenant (`spotrl token add` writes it; in Kubernetes, a "
        "mounted secret). Unset: no auth, one tenant, and `spotrl serve` listens on loopback only.",
    )
    data_dirs: str = Field(
        default="",
        description="Server directories a run spec may name paths in (model, prompts, reward model), separated by the OS path "
        "separator (':'); empty: no server path is accepted, prompt sets are uploaded with POST /v1/datasets.",
    )
    reward_service_urls: str = Field(
        default="",
        description="URL prefixes of reward services a run's reward_model term may name (comma-separated); empty: none. "
        "Workers send prompts and responses there, so only the operator's own services belong here.",
    )
    keep_policy_versions: int = Field(
        default=3,
        ge=2,
        description="Policy versions (and their trainer states) kept per run in the object store, besides any a live worker "
        "holds; older ones are deleted as each iteration is recorded. At least 2: a worker may still be on the one before the latest.",
    )
    queue_retention_s: float = Field(
        default=86400.0,
        ge=0,
        description="How long an ended run's prompt and sample topics are kept (for audits and debugging) before the scheduler deletes them.",
    )
    api_threads: int = Field(
        default=4,
        ge=1,
        le=256,
        description="Threads of the API's blocking work (state store reads and writes); raise it for a state store far away on the network.",
    )
    max_body_bytes: int = Field(
        default=4 << 20,
        ge=1024,
        description="Largest request body the API reads (a run spec); larger ones get 413 unread.",
    )
    max_dataset_bytes: int = Field(
        default=64 << 20,
        ge=1024,
        description="Largest prompt set a client may upload (POST /v1/datasets) or a spec may name.",
    )
    max_concurrent_uploads: int = Field(
        default=4,
        ge=1,
        description="Most dataset uploads (POST /v1/datasets) one API process reads at once; one more is answered 429 with Retry-After, unread.",
    )
    max_concurrent_uploads_per_tenant: int = Field(
        default=2,
        ge=1,
        description="Most dataset uploads of one tenant an API process reads at once (429 beyond), so one tenant cannot take every upload slot.",
    )
    api_request_head_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="A connection to `spotrl serve` that has not sent a whole request head (request line and headers) this long after it opened, "
        "or after its last response, is closed: a silent or trickling client holds no connection longer.",
    )
    api_keep_alive_s: int = Field(
        default=5,
        ge=1,
        description="How long `spotrl serve` keeps an idle connection open between requests (uvicorn's timeout_keep_alive).",
    )
    api_max_connections: int = Field(
        default=1000,
        ge=1,
        description="Most connections and requests `spotrl serve` serves at once (uvicorn's limit_concurrency); a request beyond gets 503 until some end.",
    )
    api_shutdown_grace_s: float = Field(
        default=30.0,
        gt=0,
        description="How long `spotrl serve` waits, when told to stop, for the requests in flight (an upload) before it closes their connections.",
    )
    max_rollout_workers: int = Field(
        default=64, ge=1, description="Most rollout workers one run may ask for (rollout.max_workers)."
    )
    max_training_processes: int = Field(
        default=8, ge=1, description="Most processes one training job may ask for (training.processes)."
    )
    max_training_nodes: int = Field(
        default=4, ge=1, description="Most machines one training job may ask for (training.nodes)."
    )
    pod_threads: int = Field(
        default=1,
        ge=1,
        description="torch threads per local pod: local pods share this machine's cores, and oversubscribed threads slow every pod down.",
    )
    launcher: Literal["local", "kubernetes"] = Field(
        default="local",
        description="Where pods run: local processes under home, or a Kubernetes namespace (services/ports/launcher/kubernetes_launcher.py).",
    )
    kube_config: Path | None = Field(
        default=None,
        description="The kubeconfig of the Kubernetes launcher; unset: the service account's in-cluster config inside a pod, else $KUBECONFIG or ~/.kube/config.",
    )
    kube_namespace: str = Field(
        default="default", description="The namespace of the Kubernetes launcher's pods and Jobs."
    )
    kube_image: str = Field(
        default="spotrl:latest",
        description="The data-plane image of the Kubernetes launcher's pods (rollout worker, training job).",
    )
    kube_rollout_image: str | None = Field(
        default=None, description="The rollout worker image (CUDA, vLLM); unset: kube_image."
    )
    kube_training_image: str | None = Field(
        default=None, description="The training job image (CUDA, DeepSpeed); unset: kube_image."
    )
    kube_image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        default=None, description="imagePullPolicy of the launcher's containers; unset: Kubernetes' default."
    )
    kube_image_pull_secrets: str = Field(
        default="", description="Image pull Secrets of the launcher's pods (names, comma-separated)."
    )
    kube_service_account: str | None = Field(
        default=None,
        description="The service account of the launcher's pods (their workload identity, e.g. for S3); its token is not mounted: a pod launches nothing.",
    )
    kube_env_secrets: str = Field(
        default="",
        description="Secrets (names, comma-separated) the launcher's pods read their environment from (envFrom): the backends' URLs and "
        "every other secret setting reach pods only through them, never as values in a pod spec. Empty: the values are passed as they are (development only).",
    )
    kube_price_catalog_configmap: str | None = Field(
        default=None,
        description="ConfigMap of the price catalog, mounted in the launcher's pods where SPOTRL_PRICE_CATALOG names it (its key: that file's name).",
    )
    kube_pod_labels: dict[str, str] = Field(
        default_factory=dict,
        description="Labels of the launcher's pods and Jobs besides its own (JSON), e.g. those a NetworkPolicy admits.",
    )
    kube_rollout_node_selector: dict[str, str] | None = Field(
        default=None, description="Node labels of the rollout pool (JSON); unset: spotrl.dev/pool=rollout."
    )
    kube_training_node_selector: dict[str, str] | None = Field(
        default=None, description="Node labels of the training pool (JSON); unset: spotrl.dev/pool=training."
    )
    kube_rollout_tolerations: list[dict[str, Any]] | None = Field(
        default=None,
        description="Tolerations of the rollout pool's pods (JSON, Kubernetes' form); unset: the pool's and the GPU nodes' taints.",
    )
    kube_training_tolerations: list[dict[str, Any]] | None = Field(
        default=None,
        description="Tolerations of the training pool's pods (JSON); unset: the pool's and the GPU nodes' taints.",
    )
    kube_reward_node_selector: dict[str, str] | None = Field(
        default=None,
        description="Node labels of the reward pool, where runs' reward servers run (JSON); unset: spotrl.dev/pool=reward.",
    )
    kube_reward_tolerations: list[dict[str, Any]] | None = Field(
        default=None,
        description="Tolerations of the reward pool's pods (JSON); unset: the pool's and the GPU nodes' taints.",
    )
    kube_reward_image: str | None = Field(
        default=None,
        description="Image of runs' reward servers (one holding the users' reward code, with spotrl); unset: the rollout image.",
    )
    kube_spot_labels: str = Field(
        default="karpenter.sh/capacity-type=spot,eks.amazonaws.com/capacityType=SPOT,cloud.google.com/gke-spot=true",
        description="Node labels of spot capacity (label=value, comma-separated; a node matching any one is spot): what spot rollout pods ask for, and how a node's capacity type is read.",
    )
    kube_spot_notice_s: int = Field(
        default=120,
        ge=1,
        le=3600,
        description="Seconds of notice the provider gives before reclaiming a spot node (AWS 120, GCP 30, Azure 30): "
        "the grace period of spot pods, in which a worker hands back its batch and a training job checkpoints.",
    )
    kube_request_fraction: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="Share of its instance type's vCPUs and memory (the price catalog's vcpus and memory_gib) each launched pod requests, "
        "so that the kubelet does not evict it first; the rest of the node stays for the kubelet's reservations and the DaemonSets.",
    )
    kube_shm_fraction: float = Field(
        default=0.25,
        gt=0,
        le=1,
        description="Share of its instance type's memory a launched pod's memory-backed /dev/shm may fill (NCCL, vLLM).",
    )
    kube_run_as_user: int = Field(
        default=10001, ge=1, description="The uid (and gid) the launched pods run as: the spotrl images' user."
    )
    kube_read_only_root: bool = Field(
        default=True,
        description="Launched containers' root filesystem read-only (/tmp, the images' home and /dev/shm are writable volumes); false for an image that writes elsewhere.",
    )
    # Experiment trackers (services.control.tracking): where they are and their credentials, never in a run spec.
    mlflow_tracking_uri: str | None = Field(
        default=None,
        repr=False,
        description="The MLflow tracking server runs with tracking.mlflow log to (http(s)://host:port); credentials in it become basic auth.",
    )
    mlflow_tracking_token: SecretStr | None = Field(
        default=None, repr=False, description="Bearer token of the MLflow server."
    )
    mlflow_tracking_token_file: Path | None = Field(
        default=None,
        description="A file holding that token (e.g. a mounted Kubernetes Secret); read when the scheduler first logs to MLflow.",
    )
    wandb_api_key: SecretStr | None = Field(
        default=None, repr=False, description="The W&B API key runs with tracking.wandb log with."
    )
    wandb_api_key_file: Path | None = Field(
        default=None, description="A file holding that key (e.g. a mounted Kubernetes Secret)."
    )
    wandb_base_url: str | None = Field(
        default=None, description="The W&B server (a dedicated or self-hosted one); unset: W&B's own."
    )
    wandb_mode: Literal["online", "offline"] = Field(
        default="online",
        description="online: log to the W&B server; offline: write the runs under wandb_dir for `wandb sync` later (no key needed).",
    )
    wandb_dir: Path | None = Field(
        default=None, description="Where W&B keeps its run files (offline: the runs themselves); default: home/wandb."
    )

    def allowed_data_dirs(self) -> list[Path]:
        """The directories of ``data_dirs``, resolved (symbolic links followed)."""
        return [Path(d).resolve() for d in self.data_dirs.split(os.pathsep) if d.strip()]

    def pod_env(self) -> dict[str, str]:
        """What a pod needs to find the same backends as the process that launched it."""
        return {
            "SPOTRL_HOME": str(self.home.resolve()),
            "SPOTRL_STATE_URL": self.resolved_state_url(),
            "SPOTRL_MODEL_CACHE": str(self.resolved_model_cache()),
            "SPOTRL_SESSION_TIMEOUT_S": str(self.session_timeout_s),
            "SPOTRL_STOP_GRACE_S": str(self.stop_grace_s),
            "SPOTRL_POD_THREADS": str(self.pod_threads),
            **{
                f"SPOTRL_{name.upper()}": value
                for name, value in (
                    ("queue_url", self.queue_url),
                    ("reward_cache_url", self.reward_cache_url),
                    ("objects_url", self.objects_url),
                )
                if value is not None
            },
        }

    def resolved_state_url(self) -> str:
        return self.state_url or f"sqlite:///{(self.home / 'state.db').resolve()}"

    def resolved_model_cache(self) -> Path:
        return (self.model_cache or self.home / "models").resolve()

    def resolved_wandb_dir(self) -> Path:
        return (self.wandb_dir or self.home / "wandb").resolve()


@cache
def get_settings() -> Settings:
    return Settings()
