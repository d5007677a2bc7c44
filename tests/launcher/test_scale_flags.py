"""Scale-out flags: worker counts with env fallbacks, the process layout per program, --only, --bus-address;
and supervisord.conf turning that layout into process groups."""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest

from launcher.cli import ROLES, programs, settings_from
from tests.launcher.serve_argv import parse

ROOT = Path(__file__).resolve().parents[2]


def test_worker_flags_reach_settings(model_dir):
    argv = ["--tokenizer-workers", "3", "--detokenizer-workers", "2", "--http-workers", "4", "--replicas", "2"]
    s = settings_from(parse(*argv), model_dir)
    assert (s.tokenizer_workers, s.detokenizer_workers, s.http_workers, s.replicas, s.num_shard) == (3, 2, 4, 2, 1)


def test_worker_flags_env_fallbacks(monkeypatch, model_dir):
    for name, value in [("TOKENIZER_WORKERS", "2"), ("DETOKENIZER_WORKERS", "3"), ("HTTP_WORKERS", "2")]:
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("REPLICAS", "2")
    monkeypatch.setenv("BUS_ADDRESS", "tcp://127.0.0.1:5550")
    monkeypatch.setenv("ONLY", "router,http")
    args = parse()
    assert (args.tokenizer_workers, args.detokenizer_workers, args.http_workers, args.replicas) == (2, 3, 2, 2)
    assert (args.bus_address, args.only) == ("tcp://127.0.0.1:5550", "router,http")
    assert parse("--replicas", "3").replicas == 3  # a flag beats its variable


@pytest.mark.parametrize("flag", ["--tokenizer-workers", "--detokenizer-workers", "--http-workers", "--replicas"])
def test_zero_workers_are_refused(model_dir, flag):
    with pytest.raises(SystemExit, match="at least 1"):
        settings_from(parse(flag, "0"), model_dir)


def test_replicas_times_shards(model_dir):
    s = settings_from(parse("--replicas", "2", "--num-shard", "2"), model_dir)
    assert (s.replicas, s.num_shard) == (2, 2)


def test_process_counts_per_program():
    args = parse("--tokenizer-workers", "2", "--detokenizer-workers", "3", "--http-workers", "4", "--replicas", "2")
    assert programs(args) == {"router": 1, "scheduler": 2, "shard": 2, "tokenizer": 2, "detokenizer": 3, "http": 4}
    args.num_shard = 2  # the layout is ready for R × S shards even though the flag is refused for now
    assert programs(args)["shard"] == 4


def test_only_runs_a_subset():
    assert programs(parse("--replicas", "2", "--only", "scheduler, shard")) == {
        "router": 0,
        "scheduler": 2,
        "shard": 2,
        "tokenizer": 0,
        "detokenizer": 0,
        "http": 0,
    }
    for bad in ("router,gpu", ","):
        with pytest.raises(SystemExit, match="--only"):
            programs(parse("--only", bad))


def test_supervisord_conf_groups_every_program():
    conf = configparser.RawConfigParser()
    conf.read(ROOT / "supervisord.conf")
    found = {s.split(":", 1)[1] for s in conf.sections() if s.startswith("program:")}
    assert found == set(ROLES)
    for role in ROLES:
        section = conf[f"program:{role}"]
        assert section["numprocs"] == f"%(ENV_SWITCHYARD_PROCS_{role.upper()})s"
        assert section["process_name"] == "%(program_name)s_%(process_num)d"
        assert 'SWITCHYARD_INDEX="%(process_num)d"' in section["environment"]


def test_replica_base_reaches_settings_and_is_not_negative(monkeypatch, model_dir):
    assert settings_from(parse("--replica-base", "2", "--replicas", "2"), model_dir).replica_base == 2
    monkeypatch.setenv("REPLICA_BASE", "1")
    assert settings_from(parse(), model_dir).replica_base == 1
    with pytest.raises(SystemExit, match="--replica-base must be at least 0"):
        settings_from(parse("--replica-base", "-1"), model_dir)


def test_worker_base_reaches_settings_and_is_not_negative(monkeypatch, model_dir):
    assert settings_from(parse("--worker-base", "2"), model_dir).worker_base == 2
    monkeypatch.setenv("WORKER_BASE", "1")
    assert settings_from(parse(), model_dir).worker_base == 1
    with pytest.raises(SystemExit, match="--worker-base must be at least 0"):
        settings_from(parse("--worker-base", "-1"), model_dir)
