"""Options of the chaos and load suite (CI defaults; larger settings on the command line) and
its summary table, printed in the terminal summary so it shows without ``-s``."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

SUMMARY_KEY = pytest.StashKey[list[tuple[str, str]]]()


@dataclass(frozen=True)
class ChaosSettings:
    """How much load and how many faults one chaos run brings."""

    num_requests: int
    num_hostile: int
    num_cancels: int
    num_duplicates: int
    max_tokens: int
    routing: bool = False  # workers --routing on, clients routing=True, sessions pinned

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
