"""Rank 0 starts ranks 1..N-1 as processes of their own, watches them, and stops them.

Each rank is ``python -m engine.distributed.rank_main`` with its ``RankSpec`` pickled on stdin
(no re-import of the caller's ``__main__``, which ``multiprocessing``'s spawn would need). All
ranks meet on a free localhost port, load their shard and build their runtime together; then
rank 0 runs the engine and the others serve its steps (``rank_main``).

Stopping waits on nothing without a bound (``RankProcesses.stop``), at ``shutdown()``, at
exit or after Ctrl-C: rank 0 sends the stop message only to ranks that wait for it between
steps; they leave their groups and exit. Rank 0 gives them ``STOP_JOIN_S``, kills the rest and
only then leaves its own side, by aborting its communicators: NCCL's
``destroy_process_group`` waits for the other ranks, forever if one is gone or stuck.

A rank that dies must not leave the others waiting in a collective forever. Rank 0 checks
its children before and after every step and turns a failed collective into
``EngineDeadError``; a watcher thread aborts the device group's communicators when a rank dies
mid-step on CUDA (a NCCL collective waits for a dead peer; gloo's fails at once) and ends the
process if the step is still stuck ``STUCK_AFTER_DEATH_S`` later. The other ranks end when
rank 0's process goes away, and leave Ctrl-C to rank 0.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.distributed.group import TensorParallelGroup
from engine.distributed.step_channel import ChannelEnd, StepChannel
from engine.errors import ConfigError, EngineDeadError
from engine.loader import ModelSource

logger = logging.getLogger("pagestream.engine")

TIMEOUT_ENV = "PAGESTREAM_TP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0  # rendezvous and collectives: loading a large shard is slow
WATCH_INTERVAL_S = 0.2
STUCK_AFTER_DEATH_S = 10.0  # a step still stuck this long after a rank died ends the process
STUCK_EXIT_CODE = 70
STOP_JOIN_S = 5.0  # the ranks' time to leave their groups and exit after the stop message
KILL_WAIT_S = 5.0  # a killed rank's time to go (a process inside the GPU driver takes a while)
LEAVE_TIMEOUT_S = 5.0  # aborting a rank's communicators
ENGINE_ROOT = Path(__file__).resolve().parents[2]  # the directory that holds `engine/`


def exit_with_parent(parent_pid: int) -> None:
    """Exit this process (code 1) within WATCH_INTERVAL_S of ``parent_pid``'s end, whatever
    it is doing: a rank may be stuck in a collective, an engine's process in a step."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCH_INTERVAL_S)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


@dataclass(frozen=True)
class RankSpec:
    """What a rank process needs to join: the engine's settings and where to meet."""

    config: EngineConfig
    source: ModelSource
    rank: int
    port: int
    parent_pid: int
    log_level: int  # rank 0's: the ranks log as much as it does
    steps: ChannelEnd  # where rank 0's step messages arrive


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
        self.group: TensorParallelGroup | None = None
        self._out_of_step = False  # a step began and did not end: the ranks are not told
        self._step_started_s: float | None = None  # while a step runs (for the watcher)
        self._interrupts_steps = False  # the watcher aborts a step stuck on a dead rank
        self._step_aborted = False  # ... and has done so: the step only seemed to run
        self._lock = threading.Lock()  # the watcher acts, or stop() has begun: not both
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    def start(self, device: torch.device, source: ModelSource) -> TensorParallelGroup:
        """Start ranks 1..N-1 on ``source`` and join them as rank 0."""
        if dist.is_initialized():
            raise ConfigError(
                "a tensor-parallel engine already runs in this process: shutdown() it first"
            )
        # The rendezvous store listens before any rank starts, on a port the kernel gives it:
        # a port found free and bound later may be taken meanwhile (two TP workers starting
        # on one host, or anything else).
        store = dist.TCPStore(
            "127.0.0.1", 0, self.size, is_master=True, timeout=_timeout(),
            wait_for_workers=False,
        )  # fmt: skip
        port = store.port
        env = {**os.environ, "PYTHONPATH": _python_path()}
        steps = StepChannel.create(self.size)
        for rank in range(1, self.size):
            level = logging.getLogger("pagestream.engine").getEffectiveLevel()
            end = steps.end_for(rank)
            spec = RankSpec(self.config, source, rank, port, os.getpid(), level, end)
            child = subprocess.Popen(
                [sys.executable, "-m", "engine.distributed.rank_main"],
                stdin=subprocess.PIPE,
                env=env,
                pass_fds=(end.read_fd,),
            )
            self.children.append(child)
            assert child.stdin is not None
            with contextlib.suppress(BrokenPipeError):  # it died at once: seen below
                child.stdin.write(pickle.dumps(spec))
                child.stdin.close()
        self._interrupts_steps = device.type == "cuda"
        self._watcher = threading.Thread(
            target=self._watch, name="pagestream-tp-watch", daemon=True
        )
        self._watcher.start()
        logger.info("tensor parallel: started ranks 1..%d (pids %s)", self.size - 1,
                    ", ".join(str(c.pid) for c in self.children))  # fmt: skip
        try:
            self._wait_for_ranks(store)
        finally:  # the ranks have mapped the ring by now, or failed
            steps.started()
        self.group = TensorParallelGroup.join(0, self.size, store, device, collective_timeout_s())
        self.group.steps = steps
        return self.group

    def _wait_for_ranks(self, store: dist.TCPStore) -> None:
        """Wait until every rank has reached the rendezvous ``store``; a rank that fails to
        start (an import error, no GPU memory) raises ``EngineDeadError`` instead of a long
        wait."""
        keys = [TensorParallelGroup.ready_key(rank) for rank in range(1, self.size)]
        while not store.check(keys):
            self.check_alive()
            time.sleep(WATCH_INTERVAL_S / 4)

    def exit_reports(self, only_exited: bool = False) -> list[str]:
        """``rank r (pid p) exited with code c`` (or ``... still runs``) for each child."""
        return [
            f"rank {rank} (pid {child.pid}) "
            + ("still runs" if child.returncode is None else f"exited with code {child.returncode}")
            for rank, child in enumerate(self.children, start=1)
            if child.poll() is not None or not only_exited
        ]

    def dead_ranks(self) -> list[str]:
        """``rank r (pid p) exited with code c`` for each child that is gone."""
        return self.exit_reports(only_exited=True)

    def check_alive(self) -> None:
        """Raise ``EngineDeadError`` if a rank is gone."""
        dead = self.dead_ranks()
        if dead:
            raise _dead_error(dead)

    @contextlib.contextmanager
    def collectives(self) -> Iterator[None]:
        """Around the start and each step: a failure there means a rank is gone or out of
        step (``EngineDeadError``). A step that does not end (an exception, Ctrl-C) leaves the
        ranks out of step for good."""
        if self._out_of_step:
            raise _dead_error(["step was left unfinished on rank 0 (interrupted)"])
        self.check_alive()
        self._out_of_step = True
        self._step_started_s = time.monotonic()
        try:
            yield
        except EngineDeadError:
            raise
        except RuntimeError as exc:  # gloo and NCCL raise RuntimeError subclasses
            raise self._failed_step(exc) from exc
        finally:
            self._step_started_s = None
        if self._step_aborted:  # NCCL's aborted collectives return as if they had run
            raise _dead_error(self.dead_ranks() or ["step aborted on rank 0"])
        self._out_of_step = False

    def _failed_step(self, exc: RuntimeError) -> EngineDeadError:
        deadline_s = time.monotonic() + 2.0  # the dead child may not be reaped yet
        while not self.dead_ranks() and time.monotonic() < deadline_s:
            time.sleep(0.05)
        return _dead_error(self.dead_ranks() or [f"step failed on rank 0 ({exc})"])

    def _watch(self) -> None:
        """Once a rank died mid-step: abort the device group (CUDA), so that the collective
        waiting for it returns; end the process if the step still waits a while later."""
        died_at_s: float | None = None
        while not self._stopping.wait(WATCH_INTERVAL_S):
            if died_at_s is None and self.dead_ranks():
                died_at_s = time.monotonic()
            if died_at_s is None or self._step_started_s is None:
                continue
            with self._lock:  # not once stop() has begun: it kills ranks on purpose
                if not self._stopping.is_set():
                    self._unstick_step(died_at_s)

    def _unstick_step(self, died_at_s: float) -> None:
        dead = "; ".join(self.dead_ranks())
        if self._interrupts_steps and self.group is not None:
            self._interrupts_steps = False  # once
            self._step_aborted = True
            logger.error("tensor parallel: %s mid-step: aborting the step's collectives", dead)
            run_bounded(self.group.interrupt, LEAVE_TIMEOUT_S, "aborting the step")
        if time.monotonic() - died_at_s > STUCK_AFTER_DEATH_S:
            logger.critical("tensor parallel: %s and the step has waited %.0f s on it: exiting",
                            dead, STUCK_AFTER_DEATH_S)  # fmt: skip
            os._exit(STUCK_EXIT_CODE)

    def stop(self, release: Callable[[], None] | None = None) -> None:
        """Stop the other ranks and leave the group (at ``shutdown()``, at exit, after a
        failed start), in seconds: each wait here has a bound, about 20 s in all at worst.
        The ranks get the stop message only if they wait for it between steps; those that
        have not exited ``STOP_JOIN_S`` later are killed. Rank 0 leaves its side last, once
        no other rank runs, after ``release`` drops what holds its communicators."""
        with self._lock:
            if self._stopping.is_set():
                return
            self._stopping.set()
        sender = None
        try:
            sender = self._send_stop()
            self._join(STOP_JOIN_S if sender is not None else 0.0)
        finally:  # even if interrupted (a second Ctrl-C): no rank outlives rank 0's stop
            self._kill_all()
        if sender is not None:  # it returns once the ranks are gone, told or not
            sender.join(LEAVE_TIMEOUT_S)
        if self.group is not None:
            logger.info("tensor parallel: %s; rank 0 leaves the group",
                        "; ".join(self.exit_reports()))  # fmt: skip
            if release is not None:  # what still holds the communicators (CUDA graphs)
                release()
            run_bounded(self.group.leave, LEAVE_TIMEOUT_S, "rank 0 leaving the group")

    def _send_stop(self) -> threading.Thread | None:
        """Send the stop message on a thread of its own (a rank that is alive but does not
        take it would block it), unless the ranks are not all waiting for a step."""
        group = self.group
        if group is None or self._out_of_step or self.dead_ranks():
            return None
        sender = threading.Thread(
            target=_broadcast_stop, args=(group,), name="pagestream-tp-stop", daemon=True
        )
        sender.start()
        return sender

    def _join(self, timeout_s: float) -> None:
        deadline_s = time.monotonic() + timeout_s
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(max(deadline_s - time.monotonic(), 0.0))

    def _kill_all(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.kill()
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):  # one inside the GPU driver
                child.wait(KILL_WAIT_S)


def _broadcast_stop(group: TensorParallelGroup) -> None:
    with contextlib.suppress(RuntimeError, OSError):  # a rank was killed before it took it
        group.send_step(None)


def _dead_error(causes: list[str]) -> EngineDeadError:
    return EngineDeadError(
        f"tensor-parallel {'; '.join(causes)}: the engine cannot continue "
        "(close it; a worker exits so that its requests go to another worker)"
    )


def run_bounded(action: Callable[[], None], timeout_s: float, what: str) -> bool:
    """Run ``action`` on a daemon thread and wait at most ``timeout_s`` for it: whether it
    ended. One that fails or outlasts the wait is logged and left behind."""

    def run() -> None:
        try:
            action()
        except Exception:
            logger.exception("tensor parallel: %s failed", what)

    thread = threading.Thread(target=run, name="pagestream-tp-bounded", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        logger.warning("tensor parallel: %s took over %.0f s: going on without it", what, timeout_s)
    return not thread.is_alive()


def join_ranks(rank: int, size: int, port: int, device: torch.device) -> TensorParallelGroup:
    """A rank other than 0: reach rank 0's store, say so, and form the group."""
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=_timeout())
    store.set(TensorParallelGroup.ready_key(rank), "1")
    return TensorParallelGroup.join(rank, size, store, device, collective_timeout_s())


def collective_timeout_s() -> float:
    """How long a rendezvous or a collective of the model may wait (not the idle wait for
    rank 0's next step, which has no limit)."""
    return float(os.environ.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT_S)


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=collective_timeout_s())


def _python_path() -> str:
    """The child imports this same ``engine`` package, whatever put it on our path."""
    parts = [str(ENGINE_ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return os.pathsep.join(p for p in parts if p)
