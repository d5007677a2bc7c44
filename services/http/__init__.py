"""HTTP: TGI's API and OpenAI's over aiohttp, one in-memory stream per open request; a folder per API.

- `tgi/`: `routes` (TGI's generation routes, /tokenize, /invocations, and the info routes: health, /info,
  /v1/models, /metrics, the docs) and `schemas` (its structs, and `parse_body`, which every API reads bodies with).
- `openai/`: `routes`, `requests` (the bodies and their mapping to Parameters), `responses` (the structs written)
  and `tools` (reading tool calls out of the generated text).
- Shared: `generation` (the permits, the one GenerateRequest builder, collecting rows); `errors` (Failure, TGI's
  statuses and error bodies); `responses` (JSON bodies and SSE); `timing` (Timing, the x-* headers); `middleware`
  (CORS, API key, payload limit, unexpected errors); `openapi` (the document, from every API's structs);
  `lora` (vLLM's LoRA routes); `ingress` (the bus side); `telemetry` (each request's metrics, span and log line).
A new API is a new folder whose routes `__main__.build_app` installs.
"""
