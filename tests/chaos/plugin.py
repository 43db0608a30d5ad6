"""Options of the chaos and load suite (CI defaults; larger settings on the command line) and
its summary table, printed in the terminal summary so it shows without ``-s``."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

SUMMARY_KEY = pytest.StashKey[list[tuple[str, str]]]()
CLUSTER_ENV = "PAGESTREAM_CHAOS_CLUSTER"


@dataclass(frozen=True)
class ChaosSettings:
    """How much load and how many faults one chaos run brings."""

    num_requests: int
    num_hostile: int
    num_cancels: int
    num_duplicates: int
    max_tokens: int
    routing: bool = False  # workers --routing on, clients routing=True, sessions pinned
    cluster: bool = False  # a 3-primary Redis Cluster, 3 request shards (tests/chaos/target.py)

    def __post_init__(self) -> None:
        if min(self.num_requests, self.max_tokens) < 1 or self.num_duplicates > self.num_requests:
            raise pytest.UsageError(
                "chaos: need requests >= 1, max tokens >= 1, duplicates <= requests"
            )


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("chaos", "the chaos and load suite (tests/chaos)")
    group.addoption("--chaos-requests", type=int, default=300, help="good requests (300)")
    group.addoption("--chaos-hostile", type=int, default=200, help="hostile entries (200)")
    group.addoption(
        "--chaos-cancels", type=int, default=50, help="requests cancelled mid stream (50)"
    )
    group.addoption("--chaos-duplicates", type=int, default=20, help="ids submitted twice (20)")
    group.addoption("--chaos-max-tokens", type=int, default=8, help="tokens per good request (8)")
    group.addoption(
        "--chaos-routing",
        action="store_true",
        help="with prefix-aware routing: workers --routing on, routing clients, good requests "
        "pinned to 16 sessions (docs/routing.md)",
    )
    group.addoption(
        "--chaos-cluster",
        action="store_true",
        default=os.environ.get(CLUSTER_ENV, "") == "1",
        help="on a 3-primary Redis Cluster: workers and clients with --redis-cluster on and 3 "
        f"shards; a primary is killed instead of the one Redis (also {CLUSTER_ENV}=1)",
    )


@pytest.fixture
def chaos_settings(request: pytest.FixtureRequest) -> ChaosSettings:
    option = request.config.getoption
    return ChaosSettings(
        num_requests=option("--chaos-requests"),
        num_hostile=option("--chaos-hostile"),
        num_cancels=option("--chaos-cancels"),
        num_duplicates=option("--chaos-duplicates"),
        max_tokens=option("--chaos-max-tokens"),
        routing=option("--chaos-routing"),
        cluster=option("--chaos-cluster"),
    )


@pytest.fixture
def chaos_summary(request: pytest.FixtureRequest) -> list[tuple[str, str]]:
    """Rows (figure, value) for the summary table; filled by the test."""
    rows: list[tuple[str, str]] = []
    request.config.stash[SUMMARY_KEY] = rows
    return rows


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    rows = config.stash.get(SUMMARY_KEY, [])
    if not rows:
        return
    terminalreporter.section("chaos and load summary")
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        terminalreporter.write_line(f"{name:<{width}}  {value}")
