"""Placement: least-loaded replica, prefix affinity within a slack, detokenizers spread evenly."""

import numpy as np

from libs.protocol.messages import Heartbeat
from services.router.placement import Placement


def sched(index, queue=0, running=0, ready=True):
    return Heartbeat(role="scheduler", index=index, pid=1, queue=queue, running=running, ready=ready)


def prompt(seed, n=64):
    return np.random.default_rng(seed).integers(0, 1000, n).astype(np.int32)


def test_least_loaded_and_placed_since_heartbeat_count():
    p = Placement()
    hbs = [sched(0, queue=5), sched(1, running=1), sched(2, queue=2)]
    picks = [p.choose_replica(prompt(i), hbs) for i in range(3)]
    # loads 5/1/2: replica 1 (load 1, then 2 counting our placement), then 1 or 2 tie → lower index
    assert picks[:2] == [1, 1] and picks[2] == 2
    assert picks.count(0) == 0  # the busiest replica never wins while others are lighter
    p.observe(sched(1))  # a fresh heartbeat resets what we counted for replica 1
    assert p.choose_replica(prompt(9), [sched(0, queue=5), sched(1), sched(2, queue=2)]) == 1


def test_ready_replicas_first_then_any_live_then_replica_0():
    p = Placement()
    assert p.choose_replica(prompt(0), [sched(0, ready=False), sched(1, queue=9)]) == 1
    assert p.choose_replica(prompt(1), [sched(0, queue=3, ready=False), sched(2, ready=False)]) == 2
    assert p.choose_replica(prompt(2), []) == 0


def test_prefix_affinity_within_slack_then_load_wins():
    p = Placement(slack=4)
    shared = prompt(1, 64)
    first = p.choose_replica(shared, [sched(0, queue=1), sched(1)])
    assert first == 1
    longer = np.concatenate([shared, prompt(2, 32)])
    # replica 1 is now a bit busier, but holds the prefix: affinity wins within the slack
    assert p.choose_replica(longer, [sched(0), sched(1, queue=3)]) == 1
    # far busier: load wins, and the prefix now belongs to replica 0
    assert p.choose_replica(longer, [sched(0), sched(1, queue=50)]) == 0
    assert p.choose_replica(shared, [sched(0, queue=2), sched(1, queue=1)]) == 0


def test_detokenizers_round_robin():
    p = Placement()
    detoks = [Heartbeat(role="detokenizer", index=i, pid=1) for i in range(3)]
    assert [p.choose_detokenizer(detoks) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    assert p.choose_detokenizer([]) is None


def test_siblings_of_a_group_follow_the_first_whatever_the_load():
    p = Placement(slack=0)
    short = prompt(3, 8)  # no full block: no prefix affinity to lean on
    first = p.choose_replica(short, [sched(0, queue=1), sched(1)], group="g")
    assert first == 1
    busy = [sched(0), sched(1, queue=9)]
    assert [p.choose_replica(short, busy, group="g") for _ in range(3)] == [1, 1, 1]
    assert p.choose_replica(short, busy) == 0  # the same prompt alone goes by load
    assert p.choose_replica(short, [sched(0)], group="g") == 0  # its replica gone: placed anew


def test_image_blocks_have_affinity_by_the_image():
    from libs.protocol.messages import ImageInput

    p = Placement(slack=4)
    ids = prompt(4, 64)  # the same ids: the placeholders of two different images
    cat = [ImageInput(digest="11" * 16, start=0, tokens=64, shape=[3, 2, 2])]
    dog = [ImageInput(digest="22" * 16, start=0, tokens=64, shape=[3, 2, 2])]
    assert p.choose_replica(ids, [sched(0, queue=1), sched(1)], images=cat) == 1
    # the same image: its blocks live on replica 1; another image behind the same ids: no affinity, load wins
    assert p.choose_replica(ids, [sched(0), sched(1, queue=3)], images=cat) == 1
    assert p.choose_replica(ids, [sched(0), sched(1, queue=3)], images=dog) == 0
