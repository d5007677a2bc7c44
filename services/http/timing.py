"""When a request passed each point this process can see (`Timing`), and TGI's x-* headers built from it.

The http process never sees the queue or the prefill directly: `accepted` (the router placed the request)
closes validation, the first token row closes queueing plus prefill, the last row closes inference. The
request's metrics (services.http.telemetry) split its time the same way.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

from libs.protocol.messages import FinalInfo


@dataclass
class Timing:
    """time.monotonic() at each point; filled in by Ingress.generate as the request passes them."""

    start: float
    accepted: float | None = None
    first: float | None = None
    last: float | None = None
    input_length: int = 0


def compute_type() -> str:
    """x-compute-type: env COMPUTE_TYPE as TGI; without it "gpu+optimized" (TGI's default) when an NVIDIA
    device is present, else "cpu"."""
    if os.environ.get("COMPUTE_TYPE"):
        return os.environ["COMPUTE_TYPE"]
    return "gpu+optimized" if os.path.exists("/dev/nvidia0") else "cpu"


def stream_headers(characters: str) -> dict[str, str]:
    """TGI's x-* headers on the SSE routes (sent before anything is timed)."""
    return {
        "x-compute-type": compute_type(),
        "x-compute-characters": str(len(characters)),
        "X-Accel-Buffering": "no",
    }


def timing_headers(timing: Timing, characters: str, final: FinalInfo, end: float | None = None) -> dict[str, str]:
    """TGI's headers on a finished non-streamed request.

    TGI splits its total time at the moment the request was queued (validation before) and the
    moment its batch started (queue before, inference after). The http process sees neither, so:
    validation = read → Accepted (tokenizer + router placement), queue = Accepted → first token
    row (queueing AND the prefill), inference = first token row → last one (the decode steps).
    """
    end = time.monotonic() if end is None else end
    accepted = timing.accepted or end
    first = timing.first or accepted
    last = timing.last or end
    inference = max(last - first, 0.0)
    tokens = max(final.generated_tokens, 1)

    def ms(seconds: float) -> str:
        return str(math.floor(max(seconds, 0.0) * 1000))

    return {
        "x-compute-type": compute_type(),
        "x-compute-time": repr(max(end - timing.start, 0.0)),
        "x-compute-characters": str(len(characters)),
        "x-total-time": ms(end - timing.start),
        "x-validation-time": ms(accepted - timing.start),
        "x-queue-time": ms(first - accepted),
        "x-inference-time": ms(inference),
        "x-time-per-token": ms(inference / tokens),
        "x-prompt-tokens": str(final.input_length),
        "x-generated-tokens": str(final.generated_tokens),
    }


def sum_headers(all_headers: list[dict[str, str]]) -> dict[str, str]:
    """TGI's completions headers: each prompt's numbers added up."""
    out = dict(all_headers[0])
    for key in out:
        if key == "x-compute-time":
            out[key] = repr(sum(float(h[key]) for h in all_headers))
        elif key != "x-compute-type":
            out[key] = str(sum(int(h[key]) for h in all_headers))
    return out
