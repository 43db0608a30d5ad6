"""A tensor-parallel rank other than 0: ``python -m engine.distributed.rank_main``, its
``RankSpec`` pickled on stdin (started by ``RankProcesses``; not imported by the engine).

It runs the steps rank 0 sends until rank 0 sends the stop message, then leaves its groups
without waiting on rank 0 (which waits for this process to end) and exits. Ctrl-C is rank 0's
to handle: it stops or kills this process; when rank 0's process is gone, this one ends too.
``kill -USR1`` prints every thread's stack to its stderr (a rank that seems stuck).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import pickle
import signal
import sys

import torch

from engine.distributed.group import TensorParallelGroup
from engine.distributed.ranks import (
    LEAVE_TIMEOUT_S,
    RankSpec,
    exit_with_parent,
    join_ranks,
    rank_device,
    run_bounded,
)
from engine.distributed.step_channel import StepChannel
from engine.errors import PagestreamError
from engine.memory import gc_frozen
from engine.model_runner import ModelRunner
from engine.runtime import build_prefill_shapes, setup_rank

logger = logging.getLogger("pagestream.engine")


def serve_steps(runner: ModelRunner, group: TensorParallelGroup) -> None:
    """Run every step rank 0 sends until it sends the stop message, ``None``."""
    with gc_frozen():  # the rank's model out of every full collection's walk
        while True:
            message = group.receive_step()
            if message is None:
                return
            runner.run_peer_step(message)


def leave_group(group: TensorParallelGroup, device: torch.device) -> None:
    """This rank's side of the group, once its last step's kernels have ended."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    group.leave()


def rank_main(spec: RankSpec) -> int:
    """Join the group, build this rank's shard and runtime, serve steps; the exit code."""
    # a terminal's Ctrl-C reaches every process of its group, and a rank interrupted
    # mid-collective would leave the others waiting; rank 0 stops this one
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: its stacks
    logging.basicConfig(
        level=spec.log_level, format=f"%(asctime)s rank {spec.rank} %(name)s: %(message)s"
    )
    exit_with_parent(spec.parent_pid)  # a rank outlives rank 0 by at most a moment
    config = spec.config
    device = rank_device(config, spec.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # the ranks share the host's cores
        torch.set_num_threads(max(1, torch.get_num_threads() // config.tensor_parallel_size))
    steps = StepChannel.attach(spec.steps, spec.rank)  # before rank 0 hears this rank is up
    group = join_ranks(spec.rank, config.tensor_parallel_size, spec.port, device)
    group.steps = steps
    try:
        setup = setup_rank(config, device, group, spec.source)
        build_prefill_shapes(setup, config, device)  # this thread serves the steps
        serve_steps(setup.runtime.runner, group)
        setup.runtime.runner.release_cuda_graphs()
    except PagestreamError as exc:  # rank 0 meets the same error and reports it
        logger.error("rank %d: %s", spec.rank, exc)
        return 1
    except EOFError:  # rank 0's process is gone (its watcher may not have seen it yet)
        logger.error("rank %d: rank 0 is gone; exiting", spec.rank)
        return 1
    except RuntimeError:  # a collective with a rank that is gone, or this device's own failure
        logger.exception("rank %d failed; exiting", spec.rank)
        return 1
    logger.info("rank %d: rank 0 says stop: leaving the group", spec.rank)
    run_bounded(lambda: leave_group(group, device), LEAVE_TIMEOUT_S, f"rank {spec.rank} leaving")
    return 0


if __name__ == "__main__":
    exit_code = rank_main(pickle.loads(sys.stdin.buffer.read()))
    logging.shutdown()
    # no interpreter teardown (a second of unloading torch that rank 0 waits on), as
    # multiprocessing's own children end
    os._exit(exit_code)
