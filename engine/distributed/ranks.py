"""Rank 0 starts ranks 1..N-1 as processes of their own, watches them, and stops them.

Each rank is ``python -m engine.distributed.rank_main`` with its ``RankSpec`` pickled on stdin
(no re-import of the caller's ``__main__``, which ``multiprocessing``'s spawn would need). All
ranks meet on a free localhost port, load their shard and build their runtime together; then
rank 0 runs the engine and the others loop on ``serve_steps``.

A rank that dies must not leave the others waiting in a collective forever. Rank 0 checks
its children before every step, turns a failed collective into ``EngineDeadError``, and a
watcher thread ends the process if a step stays stuck after a child died (an NCCL
collective waits for a dead peer; gloo's fails at once). The other ranks end when rank 0's
process goes away.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.distributed.group import TensorParallelGroup
from engine.errors import ConfigError, EngineDeadError
from engine.loader import ModelSource
from engine.model_runner import ModelRunner

logger = logging.getLogger("pagestream.engine")

COLLECTIVE_TIMEOUT_S = 600.0  # rendezvous and collectives: loading a large shard is slow
WATCH_INTERVAL_S = 0.2
STUCK_AFTER_DEATH_S = 15.0  # a step still stuck this long after a rank died ends the process
STUCK_EXIT_CODE = 70
STOP_JOIN_S = 10.0
ENGINE_ROOT = Path(__file__).resolve().parents[2]  # the directory that holds `engine/`


@dataclass(frozen=True)
class RankSpec:
    """What a rank process needs to join: the engine's settings and where to meet."""

    config: EngineConfig
    source: ModelSource
    rank: int
    port: int
    parent_pid: int
    log_level: int  # rank 0's: the ranks log as much as it does


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank ``r`` runs on the configured device's index + ``r`` (the CPU for every rank)."""
    device = torch.device(config.resolved_device())
    if device.type != "cuda" or config.tensor_parallel_size == 1:
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def check_devices(config: EngineConfig) -> None:
    """A ``ConfigError`` unless each rank has a GPU of its own (when running on CUDA)."""
    device = rank_device(config, 0)
    size = config.tensor_parallel_size
    if device.type == "cuda" and (device.index or 0) + size > torch.cuda.device_count():
        raise ConfigError(
            f"--tensor-parallel-size {size} from {device} needs {size} GPUs; "
            f"{torch.cuda.device_count()} are visible"
        )


class RankProcesses:
    """Rank 0's handle on the other ranks: start them, notice a death, stop them."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.size = config.tensor_parallel_size
        self.children: list[subprocess.Popen[bytes]] = []
        self._in_step_since: float | None = None
        self._death_seen = threading.Event()
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    def start(self, device: torch.device, source: ModelSource) -> TensorParallelGroup:
        """Start ranks 1..N-1 on ``source`` and join them as rank 0."""
        if dist.is_initialized():
            raise ConfigError(
                "a tensor-parallel engine already runs in this process: shutdown() it first"
            )
        port = _free_port()
        env = {**os.environ, "PYTHONPATH": _python_path()}
        for rank in range(1, self.size):
            level = logging.getLogger("pagestream.engine").getEffectiveLevel()
            spec = RankSpec(self.config, source, rank, port, os.getpid(), level)
            child = subprocess.Popen(
                [sys.executable, "-m", "engine.distributed.rank_main"],
                stdin=subprocess.PIPE,
                env=env,
            )
            self.children.append(child)
            assert child.stdin is not None
            with contextlib.suppress(BrokenPipeError):  # it died at once: seen below
                child.stdin.write(pickle.dumps(spec))
                child.stdin.close()
        self._watcher = threading.Thread(
            target=self._watch, name="pagestream-tp-watch", daemon=True
        )
        self._watcher.start()
        logger.info("tensor parallel: started ranks 1..%d (pids %s)", self.size - 1,
                    ", ".join(str(c.pid) for c in self.children))  # fmt: skip
        store = self._wait_for_ranks(port)
        return TensorParallelGroup.join(0, self.size, store, device, COLLECTIVE_TIMEOUT_S)

    def _wait_for_ranks(self, port: int) -> dist.TCPStore:
        """The rendezvous store, once every rank has reached it; a rank that fails to start
        (an import error, no GPU memory) raises ``EngineDeadError`` instead of a long wait."""
        store = dist.TCPStore(
            "127.0.0.1", port, self.size, is_master=True, timeout=_timeout(),
            wait_for_workers=False,
        )  # fmt: skip
        keys = [TensorParallelGroup.ready_key(rank) for rank in range(1, self.size)]
        while not store.check(keys):
            self.check_alive()
            time.sleep(WATCH_INTERVAL_S / 4)
        return store

    def dead_ranks(self) -> list[str]:
        """``rank r (pid p) exited with code c`` for each child that is gone."""
        return [
            f"rank {rank} (pid {child.pid}) exited with code {child.returncode}"
            for rank, child in enumerate(self.children, start=1)
            if child.poll() is not None
        ]

    def check_alive(self) -> None:
        """Raise ``EngineDeadError`` if a rank is gone."""
        dead = self.dead_ranks()
        if dead:
            raise self._dead_error(dead)

    @contextlib.contextmanager
    def collectives(self) -> Iterator[None]:
        """Around the start and each step: a failure there means a rank is gone or out of
        step (``EngineDeadError``); a wait that outlasts a rank's death ends the process."""
        self.check_alive()
        self._in_step_since = time.monotonic()
        try:
            yield
        except EngineDeadError:
            raise
        except RuntimeError as exc:  # gloo and NCCL raise RuntimeError subclasses
            deadline_s = time.monotonic() + 2.0  # the dead child may not be reaped yet
            while not self.dead_ranks() and time.monotonic() < deadline_s:
                time.sleep(0.05)
            causes = self.dead_ranks() or [f"step failed on rank 0 ({exc})"]
            raise self._dead_error(causes) from exc
        finally:
            self._in_step_since = None

    def _dead_error(self, causes: list[str]) -> EngineDeadError:
        self._death_seen.set()
        return EngineDeadError(
            f"tensor-parallel {'; '.join(causes)}: the engine cannot continue "
            "(close it; a worker exits so that its requests go to another worker)"
        )

    def _watch(self) -> None:
        """End the process if a step is stuck after a rank died (nothing else would)."""
        died_at_s: float | None = None
        while not self._stopping.wait(WATCH_INTERVAL_S):
            if died_at_s is None:
                died_at_s = time.monotonic() if self.dead_ranks() else None
                continue
            in_step = self._in_step_since is not None
            stuck = in_step and time.monotonic() - died_at_s > STUCK_AFTER_DEATH_S
            if stuck and not self._death_seen.is_set():
                logger.critical(
                    "tensor parallel: %s and the step has waited %.0f s on it: exiting",
                    "; ".join(self.dead_ranks()), STUCK_AFTER_DEATH_S,
                )  # fmt: skip
                os._exit(STUCK_EXIT_CODE)

    def stop(self, group: TensorParallelGroup | None, serving: bool) -> None:
        """Tell the ranks to stop if they are ``serving`` steps (a failed start left them
        failing or stuck: they are not told), wait for them, end the rest."""
        self._stopping.set()
        if group is not None and serving and not self.dead_ranks():
            with contextlib.suppress(RuntimeError):
                group.broadcast_object(None)
        deadline_s = time.monotonic() + STOP_JOIN_S
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(max(deadline_s - time.monotonic(), 0.0))
            if child.poll() is None:
                child.kill()
                child.wait()
        if group is not None:
            with contextlib.suppress(RuntimeError):
                group.leave()


def serve_steps(runner: ModelRunner, group: TensorParallelGroup) -> None:
    """A rank other than 0: run every step rank 0 sends until it sends ``None``."""
    while True:
        message = group.broadcast_object()
        if message is None:
            return
        runner.run_peer_step(message)


def join_ranks(rank: int, size: int, port: int, device: torch.device) -> TensorParallelGroup:
    """A rank other than 0: reach rank 0's store, say so, and form the group."""
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=_timeout())
    store.set(TensorParallelGroup.ready_key(rank), "1")
    return TensorParallelGroup.join(rank, size, store, device, COLLECTIVE_TIMEOUT_S)


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _python_path() -> str:
    """The child imports this same ``engine`` package, whatever put it on our path."""
    parts = [str(ENGINE_ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return os.pathsep.join(p for p in parts if p)
