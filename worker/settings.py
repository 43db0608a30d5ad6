"""The worker service's settings: one frozen dataclass, filled from the CLI flags."""

from __future__ import annotations

import argparse
import math
import os
import socket
from dataclasses import dataclass, field

from clients.protocol import DEFAULT_PREFIX, MAX_SHARDS

DEFAULT_REDIS_URL = "redis://localhost:6379/0"
DEFAULT_LEASE_S = 30.0
DEFAULT_MAX_DELIVERIES = 3
DEFAULT_GRACE_S = 30.0
# Every interface: Prometheus scrapes a worker from another host (pod). The endpoint is off
# unless a port is given, and it serves counters only.
DEFAULT_METRICS_HOST = "0.0.0.0"
DEFAULT_STEAL_AFTER_MS = 200
DEFAULT_PREFIX_TTL_S = 600


def default_worker_name() -> str:
    """``host-pid``: unique among the workers of one deployment."""
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class RequestLimits:
    """What one worker accepts; ``None`` = only the model's own limits apply."""

    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None  # the largest ``max_tokens`` accepted
    max_entry_bytes: int = 4 * 1024 * 1024  # larger payloads are refused undecoded


@dataclass(frozen=True)
class WorkerSettings:
    """How one worker talks to Redis and what it accepts.

    ``lease_s``: an entry in flight is renewed every ``lease_s / 3``; one idle longer than
    ``lease_s`` (its worker died) is taken over by another worker. ``max_in_flight`` caps the
    requests this worker holds at once (backpressure: it reads no more than it can admit).
    """

    redis_url: str = DEFAULT_REDIS_URL
    redis_cluster: bool = False  # redis_url names a node of a Redis Cluster
    name: str = field(default_factory=default_worker_name)
    prefix: str = DEFAULT_PREFIX
    num_shards: int = 1  # request streams read in turn (clients must place on as many)
    max_deliveries: int = DEFAULT_MAX_DELIVERIES
    lease_s: float = DEFAULT_LEASE_S
    max_in_flight: int = 256
    grace_s: float = DEFAULT_GRACE_S
    read_block_ms: int = 1000
    heartbeat_interval_s: float = 5.0
    limits: RequestLimits = field(default_factory=RequestLimits)
    metrics_port: int = 0  # Prometheus /metrics on this port; 0 = not served
    metrics_host: str = DEFAULT_METRICS_HOST
    # prefix-aware routing (docs/routing.md): a stream of its own, prefix links published
    routing: bool = False
    steal_after_ms: int = DEFAULT_STEAL_AFTER_MS
    prefix_ttl_s: int = DEFAULT_PREFIX_TTL_S
    # with routing: holding this many requests, leave the shards' new entries to idler workers
    # (worker/routing.py ``shard_yield_threshold``); None: by the engine's device; 0: never
    yield_shards_at: int | None = None

    def __post_init__(self) -> None:
        checks = (
            (self.max_deliveries >= 1, "max_deliveries must be >= 1"),
            (self.lease_s > 0, "lease_s must be > 0"),
            (self.max_in_flight >= 1, "max_in_flight must be >= 1"),
            (0 <= self.grace_s < math.inf, "grace_s must be finite and >= 0"),
            (self.read_block_ms >= 1, "read_block_ms must be >= 1"),
            (self.heartbeat_interval_s > 0, "heartbeat_interval_s must be > 0"),
            (
                bool(self.name) and not set(self.name) & set(":{}"),
                "name must be non-empty, without ':', '{' or '}'",
            ),
            (bool(self.prefix), "prefix must be non-empty"),
            (
                not (self.redis_cluster and set(self.prefix) & set("{}")),
                "prefix must not hold '{' or '}' on a Redis Cluster (it would be every key's hash tag)",
            ),
            (
                1 <= self.num_shards <= MAX_SHARDS,
                f"shards must be 1..{MAX_SHARDS}, got {self.num_shards}",
            ),
            (0 <= self.metrics_port <= 65535, "metrics_port must be 0..65535 (0: off)"),
            (self.steal_after_ms >= 0, "steal_after_ms must be >= 0"),
            (
                self.yield_shards_at is None or self.yield_shards_at >= 0,
                "yield_shards_at must be >= 0",
            ),
            (self.prefix_ttl_s >= 1, "prefix_ttl_s must be >= 1"),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def renew_interval_s(self) -> float:
        return self.lease_s / 3

    @property
    def claim_interval_s(self) -> float:
        """How often to look for entries whose lease expired."""
        return self.lease_s / 2

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, max_seqs: int) -> WorkerSettings:
        """From the flags of ``pagestream worker``; ``max_in_flight`` defaults to ``max_seqs``."""
        return cls(
            redis_url=args.redis_url,
            redis_cluster=args.redis_cluster,
            name=args.name or default_worker_name(),
            prefix=args.prefix,
            num_shards=args.shards,
            max_deliveries=args.max_deliveries,
            lease_s=args.lease_s,
            max_in_flight=args.max_in_flight or max_seqs,
            grace_s=args.grace_s,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            routing=args.routing,
            steal_after_ms=args.steal_after_ms,
            prefix_ttl_s=args.prefix_ttl_s,
            yield_shards_at=args.yield_shards_at,
            limits=RequestLimits(
                max_prompt_tokens=args.max_prompt_tokens,
                max_output_tokens=args.max_output_tokens,
                max_entry_bytes=args.max_entry_bytes,
            ),
        )
