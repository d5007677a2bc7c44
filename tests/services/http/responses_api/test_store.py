"""The stored responses: bounded (oldest first out) and expiring, on a clock of the test's own."""

from __future__ import annotations

from services.http.responses_api.schemas import Response
from services.http.responses_api.store import ResponseStore


def response(i: int) -> Response:
    return Response(
        id=f"resp_{i}", created_at=0, status="completed", model="m", output=[], parallel_tool_calls=True,
        tool_choice="auto", tools=[],
    )  # fmt: skip


def test_bounded_and_expiring():
    now = [0.0]
    store = ResponseStore(capacity=2, ttl=10.0, clock=lambda: now[0])
    for i in range(3):
        store.put(response(i), [{"role": "user", "content": str(i)}])
        now[0] += 1.0
    assert store.get("resp_0") is None and len(store) == 2  # the oldest went when the third came
    assert store.get("resp_1").conversation == [{"role": "user", "content": "1"}]
    now[0] = 11.5  # resp_1 was put at 1.0: expired; resp_2 at 2.0: still there
    assert store.get("resp_1") is None and store.get("resp_2") is not None
    assert store.delete("resp_2") and not store.delete("resp_2") and len(store) == 0
