"""How the production queue adapter reaches Kafka: ``KafkaSettings``, parsed from a ``kafka://`` URL
and the environment.

URL and settings (query parameters, else ``SPOTRL_KAFKA_<NAME>`` environment variables):
``security_protocol`` (PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL), ``ssl_cafile``, ``ssl_certfile``,
``ssl_keyfile``, ``sasl_mechanism`` (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512), ``sasl_plain_username``,
``sasl_plain_password`` (best in the environment: URLs are logged and handed to pods), ``retention_ms``
(topics' retention, default 7 days), ``replication_factor`` (default: the broker's), ``batch_size``
(the producer's ``batch.size`` in bytes, default kafka-python's 16384; 1 sends every record in a
batch of its own, which the test broker needs: tests/servers/kafka.py), ``max_record_bytes`` (the
largest record: the topics' ``max.message.bytes`` and the producer's ``max.request.size``, 16 MiB by
default, as a record holds a GRPO group of samples), and
``session_timeout_min_s``/``session_timeout_max_s``: the range of Kafka session timeouts the brokers
accept (``group.min/max.session.timeout.ms``, 6 s and 30 min by default; a port session timeout
is clamped into ``[min, min(max, 45 s)]`` for Kafka, while the port's own timeout still applies as
above). The password is never logged, shown in a repr, or put in an error message.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

_SCHEME = "kafka"
# Settings a URL query or SPOTRL_KAFKA_* variable may carry, passed to kafka-python as they are.
_SECURITY_KEYS = (
    "security_protocol",
    "ssl_cafile",
    "ssl_certfile",
    "ssl_keyfile",
    "sasl_mechanism",
    "sasl_plain_username",
    "sasl_plain_password",
)
_OTHER_KEYS = (
    "retention_ms",
    "replication_factor",
    "batch_size",
    "max_record_bytes",
    "session_timeout_min_s",
    "session_timeout_max_s",
)
_SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
_SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
_DEFAULT_RETENTION_MS = 7 * 24 * 3600 * 1000
# Kafka 3's default client session timeout: a dead consumer's partitions move after at most this long.
_DEFAULT_SESSION_MAX_S = 45.0
# Kafka's default group.min.session.timeout.ms.
_DEFAULT_SESSION_MIN_S = 6.0
# A record holds a GRPO group (contracts.samples): n samples of prompt and response tokens and
# log-probs, 8 bytes a response token, so more than Kafka's 1 MB default (16 samples of 8k tokens).
_DEFAULT_MAX_RECORD_BYTES = 16 * 2**20


@dataclass(frozen=True)
class KafkaSettings:
    """Where the brokers are and how to reach them; parsed from a ``kafka://`` URL and the environment."""

    bootstrap_servers: list[str]
    security: dict[str, str] = field(default_factory=dict, repr=False)  # kafka-python's security settings
    retention_ms: int = _DEFAULT_RETENTION_MS  # topics' retention.ms
    replication_factor: int = -1  # -1: the brokers' default.replication.factor
    session_timeout_min_s: float = _DEFAULT_SESSION_MIN_S  # the brokers' group.min.session.timeout.ms
    session_timeout_max_s: float = _DEFAULT_SESSION_MAX_S  # at most the brokers' group.max.session.timeout.ms
    batch_size: int | None = None  # the producer's batch.size in bytes; None: kafka-python's default
    max_record_bytes: int = _DEFAULT_MAX_RECORD_BYTES  # topics' max.message.bytes, the producer's max request

    @classmethod
    def from_url(cls, url: str, env: Mapping[str, str] | None = None) -> KafkaSettings:
        env = os.environ if env is None else env
        parts = urlsplit(url)
        if parts.scheme != _SCHEME or not parts.netloc:
            raise ValueError(f"a Kafka queue URL looks like kafka://host:9092[,host2:9092], got {redact(url)!r}")
        if "@" in parts.netloc:
            raise ValueError(
                "a Kafka queue URL carries no credentials: set SPOTRL_KAFKA_SASL_PLAIN_USERNAME and"
                " SPOTRL_KAFKA_SASL_PLAIN_PASSWORD (or the query parameters of the same names)"
            )
        servers = [s.strip() for s in parts.netloc.split(",") if s.strip()]
        query: dict[str, str] = {}
        for name, value in parse_qsl(parts.query, keep_blank_values=True):
            if name not in _SECURITY_KEYS + _OTHER_KEYS:
                raise ValueError(
                    f"unknown Kafka queue URL parameter {name!r}; known: {', '.join(_SECURITY_KEYS + _OTHER_KEYS)}"
                )
            query[name] = value
        values = {k: query.get(k, env.get(f"SPOTRL_KAFKA_{k.upper()}")) for k in _SECURITY_KEYS + _OTHER_KEYS}
        security = {k: v for k in _SECURITY_KEYS if (v := values[k])}
        protocol = security.setdefault("security_protocol", "PLAINTEXT").upper()
        if protocol not in _SECURITY_PROTOCOLS:
            raise ValueError(f"security_protocol must be one of {', '.join(_SECURITY_PROTOCOLS)}, got {protocol!r}")
        security["security_protocol"] = protocol
        if protocol.startswith("SASL_"):
            mechanism = security.get("sasl_mechanism", "").upper()
            if mechanism not in _SASL_MECHANISMS:
                raise ValueError(
                    f"security_protocol {protocol} needs sasl_mechanism, one of {', '.join(_SASL_MECHANISMS)}"
                )
            security["sasl_mechanism"] = mechanism
            missing = [k for k in ("sasl_plain_username", "sasl_plain_password") if k not in security]
            if missing:
                raise ValueError(
                    f"sasl_mechanism {mechanism} needs {' and '.join(missing)}"
                    f" (SPOTRL_KAFKA_{'/'.join(m.upper() for m in missing)})"
                )
        numbers = {
            "retention_ms": (int, _DEFAULT_RETENTION_MS),
            "replication_factor": (int, -1),
            "batch_size": (int, None),
            "max_record_bytes": (int, _DEFAULT_MAX_RECORD_BYTES),
            "session_timeout_min_s": (float, _DEFAULT_SESSION_MIN_S),
            "session_timeout_max_s": (float, _DEFAULT_SESSION_MAX_S),
        }
        parsed: dict[str, Any] = {}
        for name, (kind, default) in numbers.items():
            raw = values[name]
            try:
                parsed[name] = default if raw in (None, "") else kind(raw)
            except ValueError:
                raise ValueError(f"Kafka setting {name} must be a number, got {raw!r}") from None
        if parsed["session_timeout_min_s"] <= 0 or parsed["session_timeout_max_s"] < parsed["session_timeout_min_s"]:
            raise ValueError("Kafka session_timeout_min_s must be positive and at most session_timeout_max_s")
        if parsed["max_record_bytes"] < 1024:
            raise ValueError(f"Kafka max_record_bytes must be at least 1024, got {parsed['max_record_bytes']}")
        if parsed["batch_size"] is not None and parsed["batch_size"] < 1:
            raise ValueError(f"Kafka batch_size must be at least 1 byte, got {parsed['batch_size']}")
        return cls(bootstrap_servers=servers, security=security, **parsed)

    def client_config(self) -> dict[str, Any]:
        """Connection settings common to every kafka-python client (the password masked in reprs:
        kafka-python logs its configuration at debug level)."""
        config: dict[str, Any] = {"bootstrap_servers": self.bootstrap_servers, **self.security}
        if "sasl_plain_password" in config:
            config["sasl_plain_password"] = _Secret(config["sasl_plain_password"])
        return config


class _Secret(str):
    """A string that does not show itself in a repr (so neither in a logged dict of settings);
    kafka-python reads its characters (join, encode) as usual."""

    def __repr__(self) -> str:
        return "'***'"


def redact(url: str) -> str:
    """``url`` with any password parameter's value replaced, for messages and logs."""
    return re.sub(r"(sasl_plain_password=)[^&]*", r"\1***", url, flags=re.IGNORECASE)
