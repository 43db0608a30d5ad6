"""``pagestream generate``: stream one prompt's text, or run a JSONL file of prompts.

One prompt: its text goes to stdout as tokens arrive, a summary line to stderr. A file
(``--input``): one JSON object per line with ``prompt`` or ``messages``, an optional ``id`` and
any ``SamplingParams`` field overriding the sampling flags; one result per line comes out in
input order, and a bad line becomes an error record while the others still run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from commands.batch import STDIO, read_input_lines
from commands.parser import EXIT_USAGE, CommandError
from engine import (
    InvalidRequestError,
    LLMEngine,
    PagestreamError,
    RequestOutput,
    SamplingParams,
)
from engine.config_flags import add_engine_args, engine_config_from_args
from worker.arg_types import STRUCTURED_OUTPUTS_HELP, json_object
from worker.defaults import DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE, with_default_max_tokens
from worker.jsonl_lines import (
    BatchItem,
    Request,
    chat_request,
    error_record,
    parse_line,
    result_record,
    sampling_kwargs,
)

# SamplingParams fields the sampling flags set; a flag is "--" + the name with dashes ...
SAMPLING_FLAG_FIELDS = (
    "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "stop", "stop_token_ids", "ignore_eos", "logprobs",
    "structured_outputs",
)  # fmt: skip
FLAG_OF_FIELD = {"stop_token_ids": "--stop-token-id"}  # ... except for these


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``pagestream generate``: prompt or files, sampling, engine."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("prompt", nargs="?", help="the prompt; its text streams to stdout")
    source.add_argument(
        "--input",
        metavar="JSONL",
        help="one request per line: {prompt | messages, id?, <sampling field>?...}; - = stdin",
    )
    parser.add_argument(
        "--output", metavar="JSONL", help="where --input's results go (default stdout)"
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="send each prompt as one user message through the model's chat template",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar for --input")
    add_sampling_args(parser)
    add_engine_args(parser)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """Sampling flags; unset ones keep the ``SamplingParams`` defaults."""
    g = parser.add_argument_group(
        "sampling",
        "defaults for every request; fields of an --input line override them. "
        "Sampling draws from the engine's --seed; a line's own seed gives it its own generator.",
    )
    g.add_argument(
        "--max-tokens",
        type=int,
        help="most tokens to generate; past the model's context a request is refused (unless "
        f"--clamp-max-tokens on). Default {DEFAULT_MAX_TOKENS}, or what the context leaves",
    )
    g.add_argument("--min-tokens", type=int, help="generate at least this many tokens")
    g.add_argument(
        "--temperature",
        type=float,
        default=DEFAULT_TEMPERATURE,
        help="0 = greedy (the default: the same text every run)",
    )
    g.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1]")
    g.add_argument("--top-k", type=int, help="sample from the k likeliest tokens (0 = off)")
    g.add_argument("--min-p", type=float, help="drop tokens below min_p x the top probability")
    g.add_argument("--repetition-penalty", type=float, help="> 1 discourages repeats")
    g.add_argument("--presence-penalty", type=float, help="in [-2, 2]")
    g.add_argument("--frequency-penalty", type=float, help="in [-2, 2]")
    g.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable)")
    g.add_argument(
        "--stop-token-id",
        dest="stop_token_ids",
        type=int,
        action="append",
        metavar="ID",
        help="stop token id (repeatable)",
    )
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        default=None,
        help="keep generating past EOS until --max-tokens",
    )
    g.add_argument(
        "--logprobs", type=int, metavar="N", help="top-N log-probs per token in --input results"
    )
    g.add_argument(
        "--structured-outputs", type=json_object, metavar="JSON", help=STRUCTURED_OUTPUTS_HELP
    )


def sampling_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags that were given (or have a default), validated as a whole."""
    values = {name: getattr(args, name) for name in SAMPLING_FLAG_FIELDS}
    defaults = {name: value for name, value in values.items() if value is not None}
    with user_errors():
        SamplingParams(**sampling_kwargs(defaults))
    return defaults


@contextmanager
def user_errors() -> Iterator[None]:
    """Engine errors a user caused become ``CommandError``s: one line, no traceback."""
    try:
        yield
    except InvalidRequestError as exc:
        flag = FLAG_OF_FIELD.get(exc.field, "--" + exc.field.replace("_", "-"))
        where = flag if exc.field in SAMPLING_FLAG_FIELDS else exc.field
        raise CommandError(f"{where}: {exc.message}", EXIT_USAGE) from exc
    except PagestreamError as exc:  # ConfigError, ModelLoadError
        raise CommandError(str(exc)) from exc


def run(args: argparse.Namespace) -> int:
    """Handler of ``pagestream generate``; returns the exit code."""
    check_source(args)
    defaults = sampling_defaults(args)
    items = read_requests(args.input, defaults, chat=args.chat) if args.input else None
    with user_errors():
        engine = LLMEngine(engine_config_from_args(args))
    try:
        if items is None:
            request = chat_request(args.prompt) if args.chat else {"prompt": args.prompt}
            sampling = SamplingParams(**sampling_kwargs(with_default_max_tokens(defaults)))
            return stream_one(engine, request, sampling)
        with _open_output(args.output) as out:
            return run_file(engine, items, out, show_progress=not args.no_progress)
    finally:
        engine.shutdown()  # the other tensor-parallel ranks, if any


def check_source(args: argparse.Namespace) -> None:
    """The flags that apply to ``--input`` only are refused with one prompt, which streams
    plain text: there is nowhere to put its logprobs."""
    if args.input:
        return
    if args.output:
        raise CommandError("--output needs --input (one prompt streams to stdout)", EXIT_USAGE)
    if args.logprobs is not None:
        raise CommandError(
            "--logprobs applies to --input results (one prompt streams text only)", EXIT_USAGE
        )


# -- one prompt, streamed --------------------------------------------------------------------


def stream_one(engine: LLMEngine, request: Request, sampling: SamplingParams) -> int:
    """Print the text to stdout as it arrives; a summary line to stderr."""
    with user_errors():
        engine.add_request(**request, sampling=sampling)
    start_s = time.perf_counter()
    num_tokens, first_token_s, final = 0, 0.0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids and not num_tokens:
                first_token_s = time.perf_counter() - start_s
            num_tokens += len(out.new_token_ids)
            sys.stdout.write(out.text_delta)
            sys.stdout.flush()
            final = out if out.finished else final
    sys.stdout.write("\n")
    elapsed_s = time.perf_counter() - start_s
    reason = final.finish_reason.value if final and final.finish_reason else "unknown"
    print(
        f"[{num_tokens} tokens in {elapsed_s:.2f} s, {num_tokens / elapsed_s:.1f} tok/s, "
        f"first token {first_token_s:.2f} s, finish_reason={reason}]",
        file=sys.stderr,
    )
    return 0


# -- a JSONL file -------------------------------------------------------------------------------


def read_requests(source: str, defaults: dict[str, Any], *, chat: bool) -> list[BatchItem]:
    """Parse every non-blank line of ``source`` (a path, or - for stdin), numbered among the
    non-blank lines as a batch job numbers them (its default ``id``)."""
    lines = read_input_lines(source)
    return [parse_line(no, line, defaults, chat=chat) for no, line in enumerate(lines, start=1)]


class OrderedWriter:
    """Writes JSON records in input order, each as soon as every earlier one is written."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._done: dict[int, dict[str, Any]] = {}
        self._next_index = 0

    def put(self, index: int, record: dict[str, Any]) -> None:
        self._done[index] = record
        while self._next_index in self._done:
            record = self._done.pop(self._next_index)
            self._out.write(json.dumps(record, ensure_ascii=False) + "\n")
            self._next_index += 1
        self._out.flush()


def run_file(engine: LLMEngine, items: list[BatchItem], out: TextIO, *, show_progress: bool) -> int:
    """Run every valid item at once; write one record per item, in order. Always exits 0."""
    writer = OrderedWriter(out)
    in_flight = _add_all(engine, items, writer)
    start_s = time.perf_counter()
    num_tokens = 0
    with tqdm(
        total=len(items), disable=not show_progress, desc="generate", unit="req", file=sys.stderr
    ) as bar:
        bar.update(len(items) - len(in_flight))  # rejected lines are done already
        while engine.has_unfinished_requests():
            for step_out in engine.step():
                num_tokens += len(step_out.new_token_ids)
                index, result = in_flight[step_out.request_id]
                if result.add_step(step_out, time.perf_counter() - start_s):
                    writer.put(index, result_record(items[index], result))
                    bar.update(1)
            rate = num_tokens / (time.perf_counter() - start_s)
            bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)
    elapsed_s = time.perf_counter() - start_s
    num_errors = len(items) - len(in_flight)
    print(
        f"{len(items)} requests, {num_errors} errors; {num_tokens} tokens in {elapsed_s:.2f} s "
        f"({num_tokens / max(elapsed_s, 1e-9):.1f} tok/s)",
        file=sys.stderr,
    )
    return 0


def _add_all(
    engine: LLMEngine, items: list[BatchItem], writer: OrderedWriter
) -> dict[str, tuple[int, RequestOutput]]:
    """Queue every valid item; write the error record of every invalid one."""
    in_flight: dict[str, tuple[int, RequestOutput]] = {}
    for index, item in enumerate(items):
        if item.error is None and item.request is not None:
            try:
                token_ids = engine.encode_prompt(**item.request)
                request_id = engine.add_request(
                    f"line-{item.line_no}", prompt_token_ids=token_ids, sampling=item.sampling
                )
                in_flight[request_id] = index, RequestOutput(request_id, None, token_ids)
                continue
            except InvalidRequestError as exc:
                item.error = exc
        writer.put(index, error_record(item))
    return in_flight


@contextmanager
def _open_output(path: str | None) -> Iterator[TextIO]:
    if path is None or path == STDIO:
        yield sys.stdout
        return
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with Path(path).open("w", encoding="utf-8") as out:
            yield out
    except OSError as exc:  # cannot create, or cannot write (disk full)
        raise CommandError(f"--output {path}: {exc.strerror or exc}") from exc
