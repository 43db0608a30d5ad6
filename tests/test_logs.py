"""Log lines: JSON off a terminal, request and trace ids while bound, stdlib records included."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import structlog

from worker.logs import bind_request, configure_logging, get_logger

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """Leave the root logger and structlog as the test found them."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
        handler.close()
    root.setLevel(level)
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


def json_lines(err: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in err.splitlines() if line.strip()]


def test_json_when_stderr_is_not_a_tty(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging()  # capsys's stderr is no terminal
    log = get_logger("worker.service")
    with bind_request("req-1", TRACE_ID):
        log.info("request admitted", num_prompt_tokens=12)
    log.info("idle")
    bound, after = json_lines(capsys.readouterr().err)
    assert bound["event"] == "request admitted"
    assert bound["num_prompt_tokens"] == 12
    assert (bound["request_id"], bound["trace_id"]) == ("req-1", TRACE_ID)
    assert (bound["level"], bound["logger"]) == ("info", "worker.service")
    assert bound["timestamp"].endswith("Z")  # ISO 8601, UTC
    assert after["event"] == "idle"
    assert "request_id" not in after and "trace_id" not in after


def test_stdlib_records_come_out_through_structlog(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(json_logs=True)
    with bind_request("req-2", TRACE_ID):
        logging.getLogger("engine.scheduler").warning("preempted %d sequences", 3)
    [line] = json_lines(capsys.readouterr().err)
    assert line["event"] == "preempted 3 sequences"
    assert (line["level"], line["logger"]) == ("warning", "engine.scheduler")
    assert (line["request_id"], line["trace_id"]) == ("req-2", TRACE_ID)


def test_configure_twice_writes_each_line_once(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(json_logs=True)
    configure_logging(json_logs=True)
    get_logger("a").info("structlog line")
    logging.getLogger("b").info("stdlib line")
    lines = json_lines(capsys.readouterr().err)
    assert [line["event"] for line in lines] == ["structlog line", "stdlib line"]


def test_console_renderer(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(json_logs=False)
    with bind_request("req-3", TRACE_ID):
        get_logger("worker.service").info("request admitted")
    err = capsys.readouterr().err
    assert not err.lstrip().startswith("{")
    assert "request admitted" in err
    assert "request_id=req-3" in err and f"trace_id={TRACE_ID}" in err


def test_level_filters_both_kinds_of_logger(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(json_logs=True, level="warning")
    get_logger("a").info("dropped")
    logging.getLogger("b").info("dropped too")
    get_logger("a").warning("kept")
    assert [line["event"] for line in json_lines(capsys.readouterr().err)] == ["kept"]


def test_unknown_level_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown log level 'LOUD'"):
        configure_logging(level="LOUD")


def test_exceptions_are_rendered_in_json(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(json_logs=True)
    try:
        raise RuntimeError("page table full")
    except RuntimeError:
        get_logger("a").exception("step failed")
    [line] = json_lines(capsys.readouterr().err)
    assert line["level"] == "error"
    assert "RuntimeError: page table full" in line["exception"]


def test_nested_binding_restores_the_outer_ids(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(json_logs=True)
    log = get_logger("a")
    with bind_request("outer", "1" * 32):
        with bind_request("inner", "2" * 32):
            log.info("inner")
        log.info("outer")
    inner, outer = json_lines(capsys.readouterr().err)
    assert inner["request_id"] == "inner"
    assert (outer["request_id"], outer["trace_id"]) == ("outer", "1" * 32)


def test_concurrent_tasks_keep_their_own_ids(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(json_logs=True)
    log = get_logger("worker.service")

    async def handle(request_id: str, bound: asyncio.Event, other_bound: asyncio.Event) -> None:
        with bind_request(request_id, TRACE_ID):
            bound.set()
            await other_bound.wait()  # both tasks hold a binding at once
            log.info("handled")

    async def main() -> None:
        a_bound, b_bound = asyncio.Event(), asyncio.Event()
        await asyncio.gather(handle("a", a_bound, b_bound), handle("b", b_bound, a_bound))

    asyncio.run(main())
    lines = json_lines(capsys.readouterr().err)
    assert sorted(line["request_id"] for line in lines) == ["a", "b"]
