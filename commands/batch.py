"""``pagestream batch submit|status|result|abort``: batch jobs from the command line.

Client verbs: they need Redis, msgspec and arq only (never torch). See ``docs/batch.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from commands.parser import (
    EXIT_USAGE,
    CommandError,
    LazyParser,
    Subparsers,
    answered_moved,
    redact_url,
)
from worker.arg_types import add_client_sampling_args, client_sampling
from worker.settings import DEFAULT_REDIS_URL

STDIO = "-"


def register(subparsers: Subparsers) -> None:
    """Add ``batch`` and its verbs to the ``pagestream`` parser."""
    help_text = "batch jobs on the workers (arq): submit, status, result, abort"
    subparsers.add_parser("batch", help=help_text, description=help_text, configure=_configure)


def _configure(parser: argparse.ArgumentParser) -> None:
    verbs = parser.add_subparsers(
        title="verbs", dest="verb", metavar="VERB", parser_class=LazyParser
    )
    verbs.required = True
    for name, help_text, configure in (
        ("submit", "enqueue a JSONL file or prompts; prints the job id", _configure_submit),
        ("status", "state and done/total/failed of a job", _configure_status),
        ("result", "wait for a job and write its records as JSONL", _configure_result),
        ("abort", "abort a queued or running job", _configure_abort),
    ):
        verbs.add_parser(name, help=help_text, description=help_text, configure=configure)


def _add_common(parser: argparse.ArgumentParser) -> None:
    from clients.protocol import DEFAULT_PREFIX

    parser.add_argument("--redis-url", default=DEFAULT_REDIS_URL,
                        help=f"redis:// or rediss:// URL (default {DEFAULT_REDIS_URL})")  # fmt: skip
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="key prefix of the deployment")


def _add_job_id(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    parser.add_argument("job_id", help="the id printed by `pagestream batch submit`")


# -- submit --------------------------------------------------------------------------------------


def _configure_submit(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", metavar="JSONL",
                        help="a local JSONL file (- = stdin), one request per line, sent inline")  # fmt: skip
    source.add_argument("--input-on-worker", metavar="PATH",
                        help="a JSONL file the worker reads from its own filesystem")  # fmt: skip
    source.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeatable)")
    parser.add_argument("--output-on-worker", metavar="PATH",
                        help="the worker also writes the records there (JSONL, input order)")  # fmt: skip
    parser.add_argument("--id", help="job id (default: a random one); resubmitting it is a no-op")
    parser.add_argument("--chat", action="store_true", help="send prompts as one user message")
    add_client_sampling_args(parser, "defaults; fields of a line override them")
    parser.set_defaults(handler=run_submit, command_prog=parser.prog)


def run_submit(args: argparse.Namespace) -> int:
    """Handler of ``pagestream batch submit``: prints the job id."""
    sampling = client_sampling(args)
    # read before connecting: a bad file is the user's error, whether or not Redis is up
    lines = None if args.input is None else read_input_lines(args.input)
    job_id = _call(args, lambda client: client.submit_batch(
        args.prompt, lines=lines, input_path=args.input_on_worker,
        output_path=args.output_on_worker, job_id=args.id, chat=args.chat, **sampling,
    ))  # fmt: skip
    print(job_id)
    return 0


def read_input_lines(source: str) -> list[str]:
    """The non-blank lines of a JSONL ``--input`` (a path, or - for stdin), read as UTF-8.

    ``pagestream generate --input`` reads its file here too, so that a line's default ``id``
    (its number among these lines) is the one a batch job gives it. A file that cannot be
    read or is not UTF-8 is a one-line usage error.
    """
    try:
        data = sys.stdin.read() if source == STDIO else Path(source).read_bytes().decode()
    except OSError as exc:
        raise CommandError(f"--input {source}: {exc.strerror or exc}", EXIT_USAGE) from exc
    except UnicodeDecodeError as exc:
        raise CommandError(f"--input {source}: {_not_utf8(exc)}", EXIT_USAGE) from exc
    return [line for line in data.splitlines() if line.strip()]


def _not_utf8(exc: UnicodeDecodeError) -> str:
    line_no = exc.object[: exc.start].count(b"\n") + 1
    byte = exc.object[exc.start]
    return f"not UTF-8: byte 0x{byte:02x} at offset {exc.start} (line {line_no})"


# -- status, result, abort -----------------------------------------------------------------------


def _configure_status(parser: argparse.ArgumentParser) -> None:
    _add_job_id(parser)
    parser.add_argument("--json", action="store_true", help="the whole status as JSON")
    parser.set_defaults(handler=run_status, command_prog=parser.prog)


def run_status(args: argparse.Namespace) -> int:
    """Handler of ``pagestream batch status``."""
    status = _call(args, lambda client: client.batch_status(args.job_id))
    _print_status(status, as_json=args.json)
    return 0


def _configure_result(parser: argparse.ArgumentParser) -> None:
    _add_job_id(parser)
    parser.add_argument("--output", metavar="JSONL", help="write the records here (default stdout)")
    parser.add_argument("--no-wait", action="store_true", help="the records stored so far")
    parser.add_argument("--timeout-s", type=float, help="give up waiting after this long")
    parser.set_defaults(handler=run_result, command_prog=parser.prog)


def run_result(args: argparse.Namespace) -> int:
    """Handler of ``pagestream batch result``: records as JSONL, the status line to stderr."""
    result = _call(
        args,
        lambda client: client.batch_result(
            args.job_id, wait=not args.no_wait, timeout_s=args.timeout_s
        ),
    )
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in result.records)
    if args.output:
        _write_output(args.output, text)
    else:
        sys.stdout.write(text)
    _print_status(result.status, as_json=False, out=sys.stderr)
    return 0


def _write_output(path: str, text: str) -> None:
    try:  # its folder made as generate's --output makes it
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:  # a file where a folder should be, a folder, no permission, disk full
        raise CommandError(f"--output {path}: {exc.strerror or exc}") from exc


def _configure_abort(parser: argparse.ArgumentParser) -> None:
    _add_job_id(parser)
    parser.add_argument("--no-wait", action="store_true", help="do not wait for the job to stop")
    parser.set_defaults(handler=run_abort, command_prog=parser.prog)


def run_abort(args: argparse.Namespace) -> int:
    """Handler of ``pagestream batch abort``."""
    status = _call(args, lambda client: client.abort_batch(args.job_id, wait=not args.no_wait))
    _print_status(status, as_json=False)
    return 0


def _call(args: argparse.Namespace, operation: Any) -> Any:
    """``operation(client)``; what the user can fix as one line. Batch jobs take no
    ``--redis-cluster``: a cluster's node is refused as a cluster is."""
    from redis.exceptions import ResponseError

    from clients import Client, ClientError
    from clients.aio import BATCH_NEEDS_STANDALONE
    from clients.batch import BatchNotFoundError, BatchTimeoutError

    try:
        with Client(args.redis_url, prefix=args.prefix) as client:
            return operation(client)
    except (BatchNotFoundError, BatchTimeoutError, ClientError) as exc:
        raise CommandError(str(exc)) from exc
    except ResponseError as exc:
        if not answered_moved(exc):
            raise
        raise CommandError(
            f"the Redis at {redact_url(args.redis_url)} is a node of a Redis Cluster: "
            f"{BATCH_NEEDS_STANDALONE}"
        ) from exc


def _print_status(status: Any, *, as_json: bool, out: Any = None) -> None:
    import msgspec

    out = out or sys.stdout
    if as_json:
        print(msgspec.json.encode(status).decode(), file=out)
        return
    extra = f", error: {status.error}" if status.error else ""
    print(
        f"{status.job_id}: {status.state.value}, {status.done}/{status.total} done, "
        f"{status.failed} failed, attempt {status.attempt}{extra}",
        file=out,
    )
