"""The bundled client library of pagestream: enqueue requests on Redis and read their tokens.

It depends on the wire types (``clients.protocol``), redis-py and msgspec only; it never
imports torch. ``AsyncClient`` for asyncio code, ``Client`` for everything else.
"""

from clients.aio import (
    AsyncClient,
    Choice,
    ClientClosedError,
    ClientError,
    Completion,
    RequestFailedError,
    RequestTimeoutError,
)
from clients.batch import BatchResult, BatchState, BatchStatus
from clients.protocol import (
    DoneEvent,
    ErrorCode,
    ErrorEvent,
    Event,
    FinishReason,
    Request,
    RestartEvent,
    Timings,
    TokenEvent,
    Usage,
)
from clients.sync import Client

__all__ = [
    "AsyncClient",
    "BatchResult",
    "BatchState",
    "BatchStatus",
    "Choice",
    "Client",
    "ClientClosedError",
    "ClientError",
    "Completion",
    "DoneEvent",
    "ErrorCode",
    "ErrorEvent",
    "Event",
    "FinishReason",
    "Request",
    "RequestFailedError",
    "RequestTimeoutError",
    "RestartEvent",
    "Timings",
    "TokenEvent",
    "Usage",
]
