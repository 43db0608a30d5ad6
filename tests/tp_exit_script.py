"""A tiny engine of two tensor-parallel ranks, run to its end in a process of its own, so that
tests can check that the *process* exits (``tests/test_tensor_parallel_exit.py``):

    python -m tests.tp_exit_script SCENARIO [--model M] [--device D]

It generates a few tokens, then ends as ``SCENARIO`` says:

- ``shutdown``: calls ``LLM.shutdown()`` and returns;
- ``fall-off``: returns without it (the engine's finalizer stops the ranks at exit);
- ``interrupt-step``: SIGINT to this process right after rank 0 sent a step, the other
  rank mid-step (``KeyboardInterrupt`` ends the script);
- ``wait-for-ctrl-c``: decodes until the test sends SIGINT to the whole process group, as a
  terminal's Ctrl-C does;
- ``kill-rank``: SIGKILL to rank 1 mid-generation, then steps on (``EngineDeadError``).

Stdout says ``ranks PID...`` once the engine is up, ``generated`` after the first tokens and
``decoding`` once a long request runs; the engine logs at INFO on stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
from typing import Any

from engine import LLM, LLMEngine, SamplingParams
from engine.distributed.ranks import exit_with_parent

SCENARIOS = ("shutdown", "fall-off", "interrupt-step", "wait-for-ctrl-c", "kill-rank")
NUM_STEPS_BEFORE = 3  # decode steps before the interruption: the ranks are mid-generation
LONG = SamplingParams(
    temperature=0, max_tokens=100_000, ignore_eos=True, clamp_max_tokens=True
)  # to the context


def main(argv: list[str] | None = None) -> LLM:
    """Run the scenario; the ``LLM``, for the caller to keep alive until the interpreter exits."""
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=SCENARIOS)
    parser.add_argument("--model", default="dummy:tiny")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    # Ctrl-C as at a terminal: a suite started in the background by a non-interactive shell
    # (as `.ci/run &` is) hands its children SIGINT ignored, and Python then installs no
    # KeyboardInterrupt handler: the Ctrl-C scenarios would decode forever
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # a killed pytest (a call's time limit) must not leave this engine holding the GPUs
    exit_with_parent(os.getppid())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank 0 %(name)s: %(message)s")
    # on a GPU, a small engine: few CUDA graphs to capture on each rank (a minute otherwise)
    small: dict[str, Any] = (
        {"max_seqs": 8, "max_batched_tokens": 512} if args.device == "cuda" else {}
    )
    llm = LLM(args.model, device=args.device, tensor_parallel_size=2, pa_memory_mb=16, **small)
    assert llm.engine.ranks is not None
    print("ranks", *(child.pid for child in llm.engine.ranks.children), flush=True)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    (out,) = llm.generate([[1, 2, 3]], params, use_tqdm=False)
    print("generated", out.token_ids, flush=True)
    if args.scenario == "shutdown":
        llm.shutdown()
    elif args.scenario != "fall-off":
        decode_until_interrupted(llm.engine, args.scenario)
    print("end of script", flush=True)
    return llm


def decode_until_interrupted(engine: LLMEngine, scenario: str) -> None:
    """Decode long requests, one after the other, until the scenario's interruption ends it."""
    engine.add_request(prompt_token_ids=[5, 6, 7], sampling=LONG)
    for _ in range(NUM_STEPS_BEFORE):
        engine.step()
    print("decoding", flush=True)
    assert engine.ranks is not None
    if scenario == "kill-rank":
        os.kill(engine.ranks.children[0].pid, signal.SIGKILL)
    elif scenario == "interrupt-step":
        _interrupt_after_next_send(engine)
    while True:
        if not engine.has_unfinished_requests():
            engine.add_request(prompt_token_ids=[5, 6, 7], sampling=LONG)
        engine.step()


def _interrupt_after_next_send(engine: LLMEngine) -> None:
    """SIGINT to this process as soon as rank 0 has told the other rank its next step: that
    rank then waits in the step's first collective for a rank 0 that never comes."""
    runner: Any = engine.runner
    send_step = runner._send_step

    def send_then_interrupt(*args: Any) -> None:
        send_step(*args)
        os.kill(os.getpid(), signal.SIGINT)

    runner._send_step = send_then_interrupt


if __name__ == "__main__":
    kept_until_exit = main()  # the fall-off scenario's engine is stopped by its finalizer at exit
