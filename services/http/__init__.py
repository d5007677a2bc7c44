"""HTTP: TGI's API and OpenAI's over aiohttp, one in-memory stream per open request.

- `tgi_schemas`, `openai_schemas`: each API's request and response structs, which the routes decode and encode
  and the OpenAPI document (`openapi`) is generated from; `openai_tools`: TGI's tool grammar for chat.
- `routes` (TGI's routes and the info routes), `openai_api` (OpenAI's): the handlers; `generation`: what both
  share (the permits, the one GenerateRequest builder, collecting rows).
- `errors`: Failure, TGI's statuses and error bodies; `responses`: JSON bodies and SSE; `timing`: Timing and the
  x-* headers; `middleware`: CORS, API key, payload limit, unexpected errors.
- `ingress`: the bus side (submit, route events back, watchdog); `telemetry`: each request's metrics, span and
  log line, and the heartbeats' counters on /metrics.
"""
