"""Hot load / unload as one replica's scheduler runs it (services.scheduler.lora), without processes: the shards'
answers are given by hand. Every rank must answer before the route's answer goes out; a refusal on one rank
undoes the load on the others; an unload refuses new requests at once and reaches the shards only once the
adapter's last request ended; a reload under the same name seeds its prefix hashes anew."""

from types import SimpleNamespace

import pytest

from libs.protocol import topics
from libs.protocol.lora import AdapterDone, AdapterSet, LoadAdapter, ShardAdapters, ShardAdaptersAck, UnloadAdapter
from libs.protocol.messages import RequestError
from services.scheduler.batcher import Batcher
from services.scheduler.lora import LoraControl
from tests.services.scheduler.test_prefix_preempt import EOS, req, result


class _Events:
    def __init__(self):
        self.sent = []

    def publish(self, topic, msg):
        self.sent.append((topic, msg))


def _control(svc, run_dir: str = "") -> LoraControl:
    return LoraControl(
        svc.batcher,
        replica=0,
        ranks=2,
        start={"start": "/adapters/start"},
        model_id="base",
        run_dir=run_dir,
        publish=svc.events.publish,
        to_shards=svc.to_shards.append,
    )


@pytest.fixture
def control():
    batcher = Batcher(40, max_batch_size=8, max_batch_prefill_tokens=256, eos_ids={EOS}, block_size=4)
    svc = SimpleNamespace(batcher=batcher, events=_Events(), to_shards=[])
    return _control(svc), svc, svc.to_shards


def _done(svc):
    return [m for _, m in svc.events.sent if isinstance(m, AdapterDone)]


def _sets(svc):
    return [m.names for _, m in svc.events.sent if isinstance(m, AdapterSet)]


def test_load_answers_after_every_rank(control):
    c, svc, to_shards = control
    c.request(LoadAdapter(op_id="x", ingress=3, name="hot", path="/adapters/hot"))
    (msg,) = to_shards
    assert isinstance(msg, ShardAdapters) and msg.adapters == {"start": "/adapters/start", "hot": "/adapters/hot"}
    c.ack(ShardAdaptersAck(op=msg.op, rank=0))
    assert _done(svc) == [] and "hot" not in c.accepting  # rank 1 has not answered
    c.ack(ShardAdaptersAck(op=msg.op, rank=1))
    assert _sets(svc)[-1] == ["start", "hot"]
    assert [(t, d.op_id, d.error) for t, d in [(t, m) for t, m in svc.events.sent if isinstance(m, AdapterDone)]] == [
        (topics.out(3), "x", None)
    ]
    assert svc.batcher.prefix.hash_keys == {"hot": "hot\x001"}
    c.request(LoadAdapter(op_id="y", ingress=3, name="hot", path="/other"))
    assert _done(svc)[-1].status == 400 and "already been loaded" in _done(svc)[-1].error


def test_a_refusal_on_one_rank_undoes_the_load(control):
    c, svc, to_shards = control
    c.request(LoadAdapter(op_id="x", ingress=0, name="bad", path="/adapters/bad"))
    op = to_shards[-1].op
    c.ack(ShardAdaptersAck(op=op, rank=0))
    c.ack(ShardAdaptersAck(op=op, rank=1, errors={"bad": "LoRA adapter 'bad': uses DoRA"}))
    assert _done(svc)[-1].error == "LoRA adapter 'bad': uses DoRA" and _done(svc)[-1].status == 400
    assert to_shards[-1].adapters == {"start": "/adapters/start"}  # rank 0 drops it again
    assert "bad" not in c.accepting and svc.batcher.prefix.hash_keys == {}


def test_unload_waits_for_the_adapters_requests(control):
    c, svc, to_shards = control
    r = req("r1", list(range(10, 19)), 2)
    r.adapter = "start"
    assert c.admits(r)
    svc.batcher.add(r)
    p = svc.batcher.plan(1)
    c.request(UnloadAdapter(op_id="u", ingress=1, name="start"))
    assert _sets(svc)[-1] == [] and to_shards == []  # refused from now on; the shards keep it while r1 runs
    late = req("r2", [5, 6, 7], 2)
    late.adapter = "start"
    assert not c.admits(late)
    assert any(isinstance(m, RequestError) and m.error_type == "validation" for _, m in svc.events.sent)
    c.tick()
    assert to_shards == []
    svc.batcher.apply(result(p))
    svc.batcher.apply(result(svc.batcher.plan(2)))  # r1 ends at its 2 tokens
    c.tick()
    (msg,) = to_shards
    assert msg.adapters == {}
    c.ack(ShardAdaptersAck(op=msg.op, rank=0))
    c.ack(ShardAdaptersAck(op=msg.op, rank=1))
    assert _done(svc)[-1].op_id == "u" and _done(svc)[-1].error is None
    c.request(UnloadAdapter(op_id="v", ingress=1, name="start"))
    assert _done(svc)[-1].status == 404 and _done(svc)[-1].error == "The lora adapter 'start' cannot be found."


def test_a_restarted_scheduler_takes_over_the_served_set(control, tmp_path):
    """The served set is recorded in the run directory on every change; a new LoraControl (a scheduler after
    kill -9) starts from it: run-time loads kept with their folders and generations (the shards reload nothing),
    a start-up adapter unloaded at run time stays unloaded, and the next load gets a fresh generation."""
    _, svc, to_shards = control
    c = _control(svc, str(tmp_path))  # this one records (the fixture's was built without a run directory)
    assert c.restored == [] and not (tmp_path / "lora-replica-0.json").exists()
    for msg in (LoadAdapter(op_id="a", ingress=0, name="hot", path="/adapters/hot"),
                UnloadAdapter(op_id="b", ingress=0, name="start")):  # fmt: skip
        c.request(msg)
        c.ack(ShardAdaptersAck(op=to_shards[-1].op, rank=0))
        c.ack(ShardAdaptersAck(op=to_shards[-1].op, rank=1))
    assert [d.error for d in _done(svc)] == [None, None]

    svc.batcher.prefix.hash_keys.clear()
    after = _control(svc, str(tmp_path))
    assert after.restored == ["hot"] and list(after.accepting) == ["hot"]
    assert after.wanted == {"hot": "/adapters/hot"} and after.generations == {"hot": 1}
    assert svc.batcher.prefix.hash_keys == {"hot": "hot\x001"}
    after.resend()  # what the probe sends: the set the shards already hold
    assert to_shards[-1].adapters == {"hot": "/adapters/hot"} and to_shards[-1].generations == {"hot": 1}
    after.request(LoadAdapter(op_id="c", ingress=0, name="next", path="/adapters/next"))
    assert after.generations["next"] == 2


def test_a_restarted_http_process_reads_what_the_schedulers_recorded(control, monkeypatch, tmp_path):
    """http's side of the record (services/http/lora.py): before any announcement a restarted http process
    takes each replica's recorded set, the start-up list for a replica that recorded nothing; announcements win."""
    from libs.protocol.lora import KnownAdapters
    from services.http import lora as http_lora

    monkeypatch.setattr(http_lora, "KNOWN", KnownAdapters())
    assert not http_lora.seed_from_records(2, ["start"], str(tmp_path))  # nothing recorded: the list stands
    _, svc, to_shards = control
    c = _control(svc, str(tmp_path))
    c.request(LoadAdapter(op_id="a", ingress=0, name="hot", path="/adapters/hot"))
    for rank in (0, 1):
        c.ack(ShardAdaptersAck(op=to_shards[-1].op, rank=rank))
    http_lora.KNOWN.update(AdapterSet(replica=1, names=["start", "hot", "other"]))  # replica 1 announced
    assert http_lora.seed_from_records(2, ["start"], str(tmp_path))
    assert http_lora.KNOWN.by_replica == {0: ["start", "hot"], 1: ["start", "hot", "other"]}
    (tmp_path / "lora-replica-0.json").write_text("{not json")
    monkeypatch.setattr(http_lora, "KNOWN", KnownAdapters())
    assert not http_lora.seed_from_records(2, ["start"], str(tmp_path)) and http_lora.KNOWN.by_replica == {}
