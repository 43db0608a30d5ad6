"""How late the worker's event loop runs what is due: its lag.

The loop reads requests, admits them, renews leases and writes every step's tokens, and it
shares the process (and the GIL) with the engine thread. When it falls behind, a request
waits in Redis after a worker could have read it, and its first token waits after the engine
made it, yet the queue's figures look healthy. So the worker measures it: a probe asks to
wake every ``PROBE_INTERVAL_S`` and records how much later it woke. ``/metrics`` serves the
lags as a histogram (``pagestream_worker_event_loop_lag_seconds``), and each heartbeat carries
the worst since the one before (``WorkerStatus.loop_lag_max_ms``), which ``bench multiturn``
reads per worker.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from dataclasses import dataclass, field

PROBE_INTERVAL_S = 0.01  # a hundred wake-ups a second: cheap, and finer than a GPU step
# Upper bounds of the histogram's buckets, seconds (a last, unbounded one is implied)
LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass
class LoopLag:
    """The lags observed since the worker started, and the worst since the last heartbeat."""

    bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(LAG_BUCKETS_S) + 1))
    sum_s: float = 0.0
    count: int = 0
    window_max_s: float = 0.0

    def observe(self, lag_s: float) -> None:
        lag_s = max(lag_s, 0.0)  # a timer never fires early; a clock's rounding might say so
        self.bucket_counts[bisect.bisect_left(LAG_BUCKETS_S, lag_s)] += 1
        self.sum_s += lag_s
        self.count += 1
        self.window_max_s = max(self.window_max_s, lag_s)

    def cumulative_counts(self) -> list[int]:
        """Observations at or under each bound of ``LAG_BUCKETS_S``, then all of them."""
        return list(itertools.accumulate(self.bucket_counts))

    def take_window_max_s(self) -> float:
        """The worst lag since the last call (the heartbeat's figure); starts a new window."""
        worst, self.window_max_s = self.window_max_s, 0.0
        return worst

    async def probe(self, interval_s: float = PROBE_INTERVAL_S) -> None:
        """Observe the loop's lag every ``interval_s`` until cancelled."""
        while True:
            asked_s = time.monotonic()
            await asyncio.sleep(interval_s)
            self.observe(time.monotonic() - asked_s - interval_s)
