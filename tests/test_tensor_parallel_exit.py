"""A tensor-parallel engine's process ends, however it ends: ``shutdown()``, falling off the
end of the script, Ctrl-C mid-generation, a rank killed mid-generation. Each case runs
``tests/tp_exit_script.py`` in a process of its own and checks its exit status, that it ended
in bounded time, that no rank outlives it, and the order of the teardown from its log: the
other rank left (or was killed) before rank 0 left the group.

On NCCL, rank 0 leaving first (``destroy_process_group``) waited forever for ranks that were
stopping or gone; gloo's leave does not wait, so on the CPU the order is read from the log.
An interrupted step hangs on gloo too: rank 0 then sent the stop message on the control group
(no timeout) to a rank waiting in the step's all-reduce.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 120.0  # the whole script, its start included, on a slow 2-core machine
EXIT_BOUND_S = 60.0  # from the end of generation or the interruption to the process's end


@dataclass
class ExitRun:
    """What a run of ``tests.tp_exit_script`` printed, when, and how it ended."""

    returncode: int | None = None
    lines: list[str] = field(default_factory=list)
    line_times_s: list[float] = field(default_factory=list)  # time.monotonic() of each line
    exit_time_s: float = 0.0

    @property
    def output(self) -> str:
        return "".join(self.lines)

    @property
    def rank_pids(self) -> list[int]:
        found = re.search(r"^ranks ([\d ]+)$", self.output, re.M)
        return [int(pid) for pid in found.group(1).split()] if found else []

    def seconds_to_exit_after(self, prefix: str) -> float:
        """From the first line that starts with ``prefix`` to the process's end."""
        index = next(i for i, line in enumerate(self.lines) if line.startswith(prefix))
        return self.exit_time_s - self.line_times_s[index]

    def index_of(self, pattern: str) -> int:
        """The first line matching ``pattern``; -1 if none does."""
        return next((i for i, line in enumerate(self.lines) if re.search(pattern, line)), -1)


def run_exit_script(scenario: str, *args: str, ctrl_c_after: str | None = None) -> ExitRun:
    """Run the script (in a session of its own) to its end; with ``ctrl_c_after``, send
    SIGINT to its whole process group once it prints a line starting so, as Ctrl-C would.
    A run that outlasts ``RUN_TIMEOUT_S`` is killed with its ranks, and the test fails."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.tp_exit_script", scenario, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    run = ExitRun()
    reader = threading.Thread(target=_read_lines, args=(process, run), daemon=True)
    reader.start()
    try:
        if ctrl_c_after is not None:
            _wait_for_line(run, ctrl_c_after, process)
            os.killpg(process.pid, signal.SIGINT)
        run.returncode = process.wait(RUN_TIMEOUT_S)
        run.exit_time_s = time.monotonic()
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        reader.join(5)
        raise AssertionError(f"{scenario}: still running after {RUN_TIMEOUT_S:.0f} s:\n"
                             + run.output[-4000:]) from None  # fmt: skip
    reader.join(5)
    return run


def _read_lines(process: subprocess.Popen[str], run: ExitRun) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        run.line_times_s.append(time.monotonic())
        run.lines.append(line)


def _wait_for_line(run: ExitRun, prefix: str, process: subprocess.Popen[str]) -> None:
    deadline_s = time.monotonic() + RUN_TIMEOUT_S
    while not any(line.startswith(prefix) for line in list(run.lines)):
        if process.poll() is not None or time.monotonic() > deadline_s:
            raise AssertionError(f"no line {prefix!r}:\n" + run.output[-4000:])
        time.sleep(0.05)


def assert_ended_in_order(run: ExitRun, rank_exit: str, after: str) -> None:
    """Ended within ``EXIT_BOUND_S`` of the line ``after``; rank 1 ended (``rank_exit``: its
    exit code pattern) before rank 0 left the group; no rank process is left."""
    assert run.seconds_to_exit_after(after) < EXIT_BOUND_S, run.output[-4000:]
    (pid,) = run.rank_pids
    left = run.index_of(
        rf"rank 1 \(pid {pid}\) exited with code {rank_exit}; rank 0 leaves the group"
    )
    assert left >= 0, run.output[-4000:]
    assert not Path(f"/proc/{pid}").exists(), f"rank 1 (pid {pid}) outlived the script"


def assert_stopped_cleanly(run: ExitRun) -> None:
    """Rank 1 took the stop message, left and exited 0, before rank 0 left."""
    assert_ended_in_order(run, "0", after="generated")
    told = run.index_of(r"rank 1: rank 0 says stop: leaving the group")
    assert 0 <= told < run.index_of(r"rank 0 leaves the group"), run.output[-4000:]


def test_shutdown_stops_the_ranks_then_leaves() -> None:
    run = run_exit_script("shutdown")
    assert run.returncode == 0, run.output[-4000:]
    assert_stopped_cleanly(run)
    assert run.index_of("rank 0 leaves the group") < run.index_of("^end of script")


def test_falling_off_the_script_stops_the_ranks_at_exit() -> None:
    run = run_exit_script("fall-off")
    assert run.returncode == 0, run.output[-4000:]
    assert_stopped_cleanly(run)
    # by the finalizer, once the script is done
    assert run.index_of("^end of script") < run.index_of("rank 0 leaves the group")


def test_an_interrupted_step_ends_the_process_and_its_ranks() -> None:
    """The rank waits in the step's all-reduce: it is killed, not sent a stop message that
    it would never take."""
    run = run_exit_script("interrupt-step")
    assert run.returncode == -signal.SIGINT, run.output[-4000:]
    assert "KeyboardInterrupt" in run.output
    assert_ended_in_order(run, "-9", after="decoding")
    assert run.index_of("rank 0 says stop") < 0


def test_ctrl_c_mid_generation_ends_the_process_and_its_ranks() -> None:
    run = run_exit_script("wait-for-ctrl-c", ctrl_c_after="decoding")
    assert run.returncode == -signal.SIGINT, run.output[-4000:]
    # stopped if Ctrl-C came between two steps, killed if it came mid-step; never by its own
    # KeyboardInterrupt (a rank leaves Ctrl-C to rank 0)
    assert_ended_in_order(run, "(0|-9)", after="decoding")
    assert run.index_of(r"^\[rank1\].*KeyboardInterrupt") < 0


def test_a_rank_killed_mid_generation_is_an_error_and_the_process_ends() -> None:
    run = run_exit_script("kill-rank")
    assert run.returncode == 1, run.output[-4000:]
    (pid,) = run.rank_pids
    assert re.search(
        rf"EngineDeadError: tensor-parallel rank 1 \(pid {pid}\) exited with code -9", run.output
    )
    assert_ended_in_order(run, "-9", after="decoding")


# Runs the exit script as its child and passes its lines on: the test kills this process as a
# time limit kills pytest, with no chance to stop its children
PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-m", "tests.tp_exit_script", "wait-for-ctrl-c"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
print("script", child.pid, flush=True)
for line in child.stdout:
    print(line, end="", flush=True)
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's new parent may never reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_an_engine_whose_parent_is_killed_ends_with_its_ranks() -> None:
    """A test's engine process outlived a killed pytest and held 70 GiB of an H100: the
    exit script (and the two-GPU tests' engine process) end within moments of their parent,
    and their ranks with them."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], cwd=ROOT, stdout=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    run = ExitRun()
    reader = threading.Thread(target=_read_lines, args=(parent, run), daemon=True)
    reader.start()
    try:
        _wait_for_line(run, "decoding", parent)
        script = int(re.search(r"^script (\d+)$", run.output, re.M).group(1))  # type: ignore[union-attr]
        pids = [script, *run.rank_pids]
        assert len(pids) == 2 and all(map(_running, pids)), run.output[-4000:]
        parent.kill()
        deadline_s = time.monotonic() + 10.0
        while any(map(_running, pids)) and time.monotonic() < deadline_s:
            time.sleep(0.1)
        left = [pid for pid in pids if _running(pid)]
        assert not left, f"{left} outlived their killed parent"
    finally:  # whatever is left of the group, the script and its rank included
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
        reader.join(5)
        assert parent.stdout is not None
        parent.stdout.close()
