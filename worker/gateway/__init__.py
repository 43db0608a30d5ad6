"""The OpenAI-compatible HTTP gateway: the OpenAI API in front of the Redis protocol.

A gateway is a client of the workers like any other (``clients.AsyncClient``): it holds no
state of its own, so any number of them can stand in front of one Redis. It never imports
torch or the engine. Pieces, one role each:

- ``config``: the gateway's settings (a frozen, validated dataclass);
- ``openai_types``: the OpenAI request and response bodies as ``msgspec.Struct``s;
- ``errors``: OpenAI's error object and the status codes;
- ``translate``: OpenAI requests to protocol requests (and what is refused);
- ``responses``: protocol events to OpenAI bodies, whole or streamed;
- ``sse``: the generation response (server-sent events or one JSON body), cancelling the
  request when the HTTP client goes away;
- ``models``: the live workers and their models, from the heartbeats;
- ``metrics``: Prometheus text for ``/metrics``;
- ``app``: the Starlette application (routes, auth, body limit).
"""
