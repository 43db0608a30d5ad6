"""Structured logging for the worker: structlog in front, the stdlib `logging` tree behind it.

Every line goes through one handler on the root logger, so the engine's
`logging.getLogger(__name__)` records and the worker's structlog calls come out in one format:
JSON lines when stderr is not a terminal (a container, a log shipper), a coloured console
renderer when it is. Each line carries an ISO-8601 UTC `timestamp`, `level`, `logger`, and the
`request_id` / `trace_id` bound by `bind_request` for as long as a request is being handled.

    configure_logging()
    log = get_logger(__name__)
    with bind_request(request_id, trace.trace_id):
        log.info("request admitted", num_prompt_tokens=12)
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

import structlog
from structlog.typing import Processor

__all__ = ["bind_request", "configure_logging", "get_logger"]


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at emit time.

    A plain StreamHandler keeps the stream it was built with; this one follows `sys.stderr`
    when a test harness (or a daemonizer) swaps it, instead of writing into a closed file.
    """

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def _shared_processors() -> list[Processor]:
    """Processors for both structlog calls and foreign (stdlib) records, before rendering."""
    return [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.ExtraAdder(),
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]


def _final_processors(json_logs: bool) -> list[Processor]:
    """The handler's last steps: drop structlog's bookkeeping keys, then render one line."""
    if json_logs:
        return [
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ]
    # The console renderer formats exceptions itself (format_exc_info before it would warn).
    return [
        structlog.stdlib.ProcessorFormatter.remove_processors_meta,
        structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()),
    ]


def configure_logging(*, json_logs: bool | None = None, level: str = "INFO") -> None:
    """Route structlog and stdlib logging through one stderr handler on the root logger.

    Args:
        json_logs: True for one JSON object per line, False for the console renderer, None
            (default) to decide from the terminal: JSON unless stderr is a TTY.
        level: the root logger's level name ("DEBUG", "INFO", "WARNING", ...).

    Idempotent: a second call replaces the handler it installed before (with the new format
    and level) instead of adding another, so no line is written twice. Handlers installed
    by others (pytest's capture, for instance) are left alone.
    """
    if json_logs is None:
        json_logs = not sys.stderr.isatty()
    numeric_level = logging.getLevelName(level.upper())
    if not isinstance(numeric_level, int):
        raise ValueError(f"unknown log level {level!r}; use DEBUG, INFO, WARNING or ERROR")
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *_shared_processors(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler = _StderrHandler()
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=_shared_processors(),
            processors=_final_processors(json_logs),
        )
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _StderrHandler)]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(numeric_level)


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    """A structlog logger named `name` (use `__name__`), rendered by `configure_logging`."""
    logger: structlog.stdlib.BoundLogger = structlog.stdlib.get_logger(name)
    return logger


@contextlib.contextmanager
def bind_request(request_id: str, trace_id: str) -> Iterator[None]:
    """Tag every line logged in this context (this task or thread) with the request's ids.

    Uses structlog's contextvars, so each asyncio task handling a request sees only its own
    ids; on exit the previous values (if any, e.g. an outer binding) are restored.
    """
    tokens = structlog.contextvars.bind_contextvars(request_id=request_id, trace_id=trace_id)
    try:
        yield
    finally:
        structlog.contextvars.reset_contextvars(**tokens)
