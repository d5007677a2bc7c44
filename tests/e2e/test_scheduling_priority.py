"""Priority scheduling and the gateway metrics on a real server (tiny model, --scheduling-policy priority, a batch
of one): the vLLM-named gauges move with load (running, waiting, KV use), and a high-priority request sent behind a
full queue preempts the running one and finishes first; the preempted one resumes and its answer is unchanged."""

from __future__ import annotations

import threading
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.server import Server

pytestmark = pytest.mark.e2e

LONG = 1000  # tokens per low-priority answer: long enough for a queue to be seen between heartbeats, and for
# a short request to end well before the one it preempted
PREEMPTIONS = "switchyard_scheduler_priority_preemptions_total"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "priority-server.log"
    flags = ["--max-total-tokens", "2048", "--max-input-tokens", "64", "--max-batch-size", "1"]
    with Server(tiny_model_dir, log, *flags, "--scheduling-policy", "priority") as server:
        yield server


def scrape(url: str) -> dict[str, float]:
    """The replica's gateway gauges (vLLM names, engine 0) and its priority preemptions."""
    out = {}
    for fam in text_string_to_metric_families(requests.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name.startswith("vllm:num_requests") or s.name == "vllm:kv_cache_usage_perc":
                assert s.labels["engine"] == "0" and s.labels["model_name"]
                out[s.name] = s.value
            elif s.name == PREEMPTIONS:
                out[s.name] = s.value
    return out


def poll(url: str, until, timeout: float = 120.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = scrape(url)
        if until(m):
            return m
        time.sleep(0.05)
    raise TimeoutError(f"metrics never showed the condition: {scrape(url)}")


def complete(url: str, prompt: str, max_tokens: int, priority: int = 0) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "priority": priority}
    r = requests.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


class Background:
    """Requests sent on threads, each one's answer and when it finished; a request that fails is kept with its error
    (`failed`), so a test sees it at once instead of waiting for a load that never came."""

    def __init__(self, url: str):
        self.url, self.done, self.threads = url, {}, []
        self.failed: dict[str, Exception] = {}

    def send(self, name: str, prompt: str, max_tokens: int, priority: int = 0) -> None:
        def run():
            try:
                text = complete(self.url, prompt, max_tokens, priority)
            except Exception as e:  # reported by the test, not lost with this thread
                self.failed[name] = e
                return
            self.done[name] = (time.monotonic(), text)

        self.threads.append(threading.Thread(target=run, daemon=True))
        self.threads[-1].start()

    def outstanding(self) -> int:
        return sum(t.is_alive() for t in self.threads)

    def check(self) -> None:
        assert not self.failed, self.failed

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=300)
        self.check()


def test_gateway_metrics_move_with_load(server):
    """The gauges are sampled: the scheduler sets them at its heartbeat and its metrics reach /metrics with a later
    one, at most once a second and less often while rendering them is slow (a loaded machine). So the load is kept
    up (three requests outstanding, a batch of one: one runs, the others wait) until a sample shows it, however late
    that sample comes, instead of a fixed load that may end between two samples."""
    idle = poll(server.url, lambda m: m.get("vllm:num_requests_running") == 0)
    assert idle["vllm:num_requests_waiting"] == 0 and idle["vllm:kv_cache_usage_perc"] == 0
    bg = Background(server.url)

    def loaded(m: dict[str, float]) -> bool:
        bg.check()  # a request that failed: say so now
        while bg.outstanding() < 3:
            bg.send(f"r{len(bg.threads)}", f"load {len(bg.threads)}", LONG // 2)
        return m["vllm:num_requests_running"] == 1 and m["vllm:num_requests_waiting"] >= 1

    busy = poll(server.url, loaded)
    assert 0 < busy["vllm:kv_cache_usage_perc"] <= 1  # the running request holds KV blocks
    bg.join()
    assert len(bg.done) == len(bg.threads) >= 3
    poll(server.url, lambda m: m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0)


def test_high_priority_overtakes_a_full_queue(server):
    alone = complete(server.url, "a long one", LONG)  # the answer with no preemption
    before = poll(server.url, lambda m: m.get("vllm:num_requests_running") == 0).get(PREEMPTIONS, 0)
    bg = Background(server.url)
    low = [f"low{i}" for i in range(4)]
    for name in low:
        bg.send(name, "a long one", LONG)
    poll(server.url, lambda m: m["vllm:num_requests_waiting"] >= 2)  # the batch (1) is full, others wait
    pending = set(low) - set(bg.done)
    assert len(pending) >= 2, bg.done
    urgent = {"inputs": "urgent", "parameters": {"max_new_tokens": 8, "priority": -5}}  # TGI's route, extended
    r = requests.post(server.url + "/generate", json=urgent, timeout=300)
    urgent_done = time.monotonic()
    assert r.status_code == 200, r.text
    bg.join()
    assert set(bg.done) == set(low)
    after = poll(server.url, lambda m: m.get(PREEMPTIONS, 0) > before)
    assert after[PREEMPTIONS] - before >= 1  # it preempted the running one
    # and overtook the queue: without priority it would have finished after every request that was waiting
    later = [name for name in low if bg.done[name][0] > urgent_done]
    assert len(later) >= 2, ({n: t - urgent_done for n, (t, _) in bg.done.items()}, pending)
    assert all(text == alone for _, text in bg.done.values())  # the preempted one resumed with the same tokens


def test_priority_fields_are_checked(server):
    r = requests.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1, "priority": "high"})
    assert r.status_code in (400, 422), r.text
    assert complete(server.url, "still serving", 2, priority=3)
