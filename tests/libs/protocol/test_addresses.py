"""Bus addresses: ipc in a run directory, tcp from one host:port, and replicas on other hosts."""

from __future__ import annotations

import pytest

from libs.protocol import Addresses


def test_ipc_addresses_live_in_the_run_directory():
    a = Addresses.parse("ipc:///tmp/switchyard-x")
    assert a.intake == "ipc:///tmp/switchyard-x/intake"
    assert a.replica(1, "plan") == "ipc:///tmp/switchyard-x/replica-1-plan"


def test_tcp_addresses_follow_the_base_port():
    a = Addresses.parse("tcp://127.0.0.1:5550")
    assert [a.intake, a.tokenize, a.admit, a.events_in, a.events_out] == [
        f"tcp://127.0.0.1:{p}" for p in range(5550, 5555)
    ]
    assert [a.replica(0, n) for n in ("in", "plan", "results")] == [f"tcp://127.0.0.1:{p}" for p in (5560, 5561, 5562)]
    assert a.replica(2, "in") == "tcp://127.0.0.1:5566"
    assert Addresses.parse("tcp://[::1]:7000").events_out == "tcp://[::1]:7004"


def test_replicas_on_another_host_from_one_base():
    a = Addresses.parse("tcp://router-host:5550?replicas=gpu-host:6000")
    assert a.intake == "tcp://router-host:5550"
    assert [a.replica(r, "in") for r in range(3)] == [f"tcp://gpu-host:{p}" for p in (6000, 6003, 6006)]
    assert a.replica(1, "results") == "tcp://gpu-host:6005"


def test_one_address_per_replica():
    a = Addresses.parse("tcp://0.0.0.0:5550?replicas=sched-0:5560,sched-1:5560")
    assert [a.replica(r, "plan") for r in range(2)] == ["tcp://sched-0:5561", "tcp://sched-1:5561"]
    with pytest.raises(ValueError, match="only 2 replica"):
        a.replica(2, "in")


@pytest.mark.parametrize(
    "spec",
    [
        "tcp://host",
        "tcp://:5550",
        "tcp://h:5550?replica=x:1",
        "tcp://h:5550?replicas=",
        "tcp://h:5550?replicas=x",
        "ipc://relative",
        "http://h:1",
    ],
)
def test_bad_specs_are_refused(spec):
    with pytest.raises(ValueError):
        Addresses.parse(spec)
