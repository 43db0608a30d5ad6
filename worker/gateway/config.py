"""The gateway's settings: one frozen dataclass, checked when made."""

from __future__ import annotations

from dataclasses import dataclass

from clients.protocol import DEFAULT_PREFIX, MAX_SHARDS, Keys

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_BODY_BYTES = 1024 * 1024  # a 1 MiB JSON body holds a prompt far beyond any context
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_CHAT_MAX_TOKENS = 1024  # OpenAI's chat API has no default; the protocol needs one
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
WORKERS_CACHE_S = 1.0  # heartbeats are read at most this often (one SCAN per second)
# --tool-call-parser / --reasoning-parser: "auto" takes what the workers detect in their
# model's chat template (their heartbeat says), "none" turns it off
TOOL_CALL_PARSERS = ("auto", "none", "hermes")
REASONING_PARSERS = ("auto", "none", "qwen3")


class GatewayConfigError(ValueError):
    """A setting is out of range."""


@dataclass(frozen=True)
class GatewaySettings:
    """What one gateway process serves and how.

    ``api_keys``: bearer tokens accepted on ``/v1/*`` (empty = no auth). ``timeout_s``: a
    request's deadline (the worker ends it as ``timeout`` then). ``tool_call_parser`` and
    ``reasoning_parser``: how chat output is read (docs/tool-calling.md).
    """

    def parsers(self, detected: tuple[str, str]) -> tuple[str | None, str | None]:
        """(tool-call parser, reasoning parser) given what the workers ``detected`` in their
        chat template ("" for none): a setting of "auto" takes the detected one."""
        chosen = []
        for setting, found in zip((self.tool_call_parser, self.reasoning_parser), detected,
                                  strict=True):  # fmt: skip
            name = found if setting == "auto" else setting
            chosen.append(None if name in ("", "none") else name)
        return chosen[0], chosen[1]

    redis_url: str = "redis://localhost:6379/0"
    redis_cluster: bool = False  # redis_url names a node of a Redis Cluster
    prefix: str = DEFAULT_PREFIX
    num_shards: int = 1  # the deployment's request streams (the workers' --shards)
    home_shard: int | None = None  # the shard this gateway's requests' keys lie on (None: spread)
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    chat_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS
    workers_cache_s: float = WORKERS_CACHE_S
    tool_call_parser: str = "auto"
    reasoning_parser: str = "auto"
    routing: bool = False  # prefix-aware routing of the requests (docs/routing.md)

    def __post_init__(self) -> None:
        checks = [
            (0 <= self.port <= 65535, f"port must be 0..65535, got {self.port}"),
            (
                1 <= self.num_shards <= MAX_SHARDS,
                f"shards must be 1..{MAX_SHARDS}, got {self.num_shards}",
            ),
            (self.max_body_bytes > 0, "max_body_bytes must be > 0"),
            (self.timeout_s > 0, "timeout_s must be > 0"),
            (self.chat_max_tokens > 0, "chat_max_tokens must be > 0"),
            (self.workers_cache_s >= 0, "workers_cache_s must be >= 0"),
            (all(self.api_keys), "an API key must not be empty"),
            (
                self.tool_call_parser in TOOL_CALL_PARSERS,
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}",
            ),
            (
                self.reasoning_parser in REASONING_PARSERS,
                f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise GatewayConfigError(message)
        if self.home_shard is not None:  # the client's own check, after the shards'
            error = Keys(self.prefix, self.num_shards).home_shard_error(self.home_shard)
            if error:
                raise GatewayConfigError(error)
