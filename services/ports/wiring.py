"""Opens the backends a process needs, from its settings: each port's adapter is chosen by its
URL (``SPOTRL_QUEUE_URL``, ``SPOTRL_REWARD_CACHE_URL``, ``SPOTRL_OBJECTS_URL``,
``SPOTRL_STATE_URL``); unset means the embedded adapter under ``SPOTRL_HOME``. The launcher is
chosen by ``SPOTRL_LAUNCHER``: ``local`` (the default) or ``kubernetes``."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from services.core.config import Settings
from services.ports.launcher.launcher import Launcher
from services.ports.launcher.local_launcher import LocalLauncher
from services.ports.objects.local_object_store import LocalObjectStore
from services.ports.objects.object_store import ObjectStore
from services.ports.prices.catalog import PriceCatalog, load_catalog
from services.ports.queue.queue import Queue
from services.ports.queue.sqlite_queue import SqliteQueue
from services.ports.reward_cache.reward_cache import RewardCache
from services.ports.reward_cache.sqlite_reward_cache import SqliteRewardCache
from services.ports.state.state_store import StateStore

if TYPE_CHECKING:
    from services.ports.launcher.kubernetes_objects import KubernetesConfig


@dataclass
class Backends:
    state: StateStore
    queue: Queue
    objects: ObjectStore
    rewards: RewardCache
    launcher: Launcher

    def close(self) -> None:
        self.queue.close()
        self.rewards.close()
        self.state.close()
        self.launcher.close()


def open_queue(url: str | None, home: Path) -> Queue:
    """``kafka://host:9092[,host2:9092]`` is Kafka (settings in the URL's query or ``SPOTRL_KAFKA_*``,
    ``services.ports.queue.kafka_queue``); unset is the SQLite queue in ``home``."""
    if url is None:
        return SqliteQueue(home / "queue.db")
    if url.startswith("kafka://"):
        from services.ports.queue.kafka_queue import KafkaQueue  # kafka-python only where Kafka is used

        return KafkaQueue(url)
    # Only the scheme is shown: the rest of a URL may hold credentials.
    scheme = f"{url.split('://', 1)[0]}://" if "://" in url else "(none)"
    raise ValueError(
        f"unsupported queue URL scheme {scheme}: the accepted one is kafka://host:9092[,host2:9092];"
        " leave the URL unset for the SQLite queue"
    )


def open_reward_cache(url: str | None, home: Path) -> RewardCache:
    """``redis://`` or ``rediss://`` (TLS): Redis; unset: the SQLite cache in ``home``."""
    if not url:
        return SqliteRewardCache(home / "reward-cache.db")
    from services.ports.reward_cache.redis_reward_cache import SCHEMES, RedisRewardCache

    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme in SCHEMES:
        return RedisRewardCache(url)
    # Name the scheme only when it looks like one: the value may hold a password.
    looks_like_one = scheme.isascii() and scheme.isalnum() and len(scheme) <= 16
    given = f"scheme {scheme!r}" if looks_like_one else "a value that is not such a URL"
    raise ValueError(
        f"SPOTRL_REWARD_CACHE_URL accepts redis://host:port/db or rediss://host:port/db (TLS), or unset for the "
        f"SQLite cache in SPOTRL_HOME; got {given}"
    )


def open_object_store(url: str | None, home: Path) -> ObjectStore:
    """``s3://bucket/prefix``: S3 or an S3-compatible service (AWS settings from the environment);
    unset (or blank): a directory in ``home``."""
    if url is None or not url.strip():
        return LocalObjectStore(home / "objects")
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme == "s3":
        from services.ports.objects.s3_object_store import S3ObjectStore  # boto3 loads only where S3 is used

        return S3ObjectStore.from_url(url)
    # Only the scheme is echoed, and only when it looks like one: the value may hold a secret.
    given = f"scheme {scheme!r}" if scheme.isascii() and scheme.isalnum() and len(scheme) <= 16 else "no URL scheme"
    raise ValueError(
        f"SPOTRL_OBJECTS_URL accepts s3://bucket/prefix (S3 or an S3-compatible service, AWS settings from the"
        f" environment), or unset for a directory in SPOTRL_HOME; got {given}"
    )


def open_launcher(settings: Settings, home: Path, *, read_nodes: bool = True) -> Launcher:
    """``kubernetes``: pods and Jobs in ``SPOTRL_KUBE_NAMESPACE`` (in-cluster config or
    ``SPOTRL_KUBE_CONFIG``), reading the nodes' identity unless ``read_nodes`` is False (a
    teardown needs none: what each pod asked for stands); ``local``: local processes under ``home``."""
    if settings.launcher == "kubernetes":
        from services.ports.launcher.kubernetes_launcher import KubernetesLauncher  # the client only where used

        return KubernetesLauncher.from_environment(
            replace(kubernetes_config(settings), read_nodes=read_nodes),
            str(settings.kube_config) if settings.kube_config else None,
        )
    return LocalLauncher(home / "pods")


def kubernetes_config(settings: Settings) -> KubernetesConfig:
    """The Kubernetes launcher's configuration from the ``SPOTRL_KUBE_*`` settings; a pool's unset
    node selector or tolerations are the launcher's defaults."""
    from services.ports.launcher.kubernetes_objects import KubernetesConfig

    defaults = KubernetesConfig()
    return KubernetesConfig(
        namespace=settings.kube_namespace,
        image=settings.kube_image,
        images={
            role: image
            for role, image in (
                ("rollout", settings.kube_rollout_image),
                ("training", settings.kube_training_image),
                ("reward", settings.kube_reward_image),
            )
            if image
        },
        image_pull_policy=settings.kube_image_pull_policy,
        image_pull_secrets=_names(settings.kube_image_pull_secrets),
        service_account=settings.kube_service_account,
        env_secrets=_names(settings.kube_env_secrets),
        price_catalog_configmap=settings.kube_price_catalog_configmap,
        pod_labels=settings.kube_pod_labels,
        spot_labels=dict(pair.split("=", 1) for pair in _names(settings.kube_spot_labels)),
        node_selectors=defaults.node_selectors
        | {
            role: selector
            for role, selector in (
                ("rollout", settings.kube_rollout_node_selector),
                ("training", settings.kube_training_node_selector),
                ("reward", settings.kube_reward_node_selector),
            )
            if selector is not None
        },
        tolerations=defaults.tolerations
        | {
            role: tolerations
            for role, tolerations in (
                ("rollout", settings.kube_rollout_tolerations),
                ("training", settings.kube_training_tolerations),
                ("reward", settings.kube_reward_tolerations),
            )
            if tolerations is not None
        },
        spot_notice_s=settings.kube_spot_notice_s,
        request_fraction=settings.kube_request_fraction,
        shm_fraction=settings.kube_shm_fraction,
        run_as_user=settings.kube_run_as_user,
        read_only_root=settings.kube_read_only_root,
    )


def _names(value: str) -> tuple[str, ...]:
    """The items of a comma-separated setting."""
    return tuple(n.strip() for n in value.split(",") if n.strip())


def open_backends(settings: Settings) -> Backends:
    home = settings.home.resolve()
    home.mkdir(parents=True, exist_ok=True)
    return Backends(
        state=StateStore(settings.resolved_state_url()),
        queue=open_queue(settings.queue_url, home),
        objects=open_object_store(settings.objects_url, home),
        rewards=open_reward_cache(settings.reward_cache_url, home),
        launcher=open_launcher(settings, home),
    )


def open_prices(settings: Settings) -> PriceCatalog:
    """The price catalog (``load_catalog``), with live AWS spot prices when ``settings.live_prices``
    (``services.ports.prices.live_prices``, imported only then: boto3 is slow to import)."""
    catalog = load_catalog()
    if not settings.live_prices:
        return catalog
    from services.ports.prices.live_prices import AwsSpotPrices, LivePriceCatalog

    return LivePriceCatalog(catalog.currency, catalog.instances, AwsSpotPrices(settings.live_prices_ttl_s))
