"""--cpu-threads, --cpu-bind, --cpu-reserved and vLLM's variable names: checked at launch with clear errors, carried
to the services as given, and the wait policy chosen at start from others' load."""

import pytest

from launcher.cli import settings_from
from launcher.serve_settings import omp_environment
from libs.runtime import cpu_team
from libs.runtime.settings import Settings
from tests.launcher.serve_argv import parse


def test_defaults_are_auto(model_dir):
    s = settings_from(parse(), model_dir)
    assert (s.cpu_threads, s.cpu_bind, s.cpu_reserved) == ("auto", "auto", "auto")


def test_flags_and_vllm_names_reach_the_settings(model_dir, monkeypatch):
    first = cpu_team.usable_cpus()[0]
    s = settings_from(parse("--cpu-threads", "1", "--cpu-bind", str(first), "--cpu-reserved", "0"), model_dir)
    assert (s.cpu_threads, s.cpu_bind, s.cpu_reserved) == ("1", str(first), "0")
    assert Settings.from_env(s.to_env()).cpu_bind == str(first)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    s = settings_from(parse(), model_dir)
    assert (s.cpu_bind, s.cpu_reserved) == ("none", "0")


@pytest.mark.parametrize(
    "argv, why",
    [
        (("--cpu-threads", "0"), "--cpu-threads must be at least 1"),
        (("--cpu-threads", "many"), "--cpu-threads must be a number or auto"),
        (("--cpu-threads", "100000"), "more than the"),
        (("--cpu-bind", "0-2-"), "not a core number"),
        (("--cpu-bind", "100000"), "are not usable by this process"),
        (("--cpu-reserved", "-1"), "--cpu-reserved must be from 0"),
    ],
)
def test_bad_values_stop_the_launcher_with_the_reason(model_dir, argv, why):
    with pytest.raises(SystemExit, match=why):
        settings_from(parse(*argv), model_dir)


def test_the_wait_policy_follows_the_load_at_start_unless_set():
    busy = {c: 1.0 for c in cpu_team.usable_cpus()}
    assert omp_environment(Settings(), {}, others=busy) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert omp_environment(Settings(), {}, others={}) == {}
    assert omp_environment(Settings(), {"OMP_WAIT_POLICY": "ACTIVE"}, others=busy) == {}
