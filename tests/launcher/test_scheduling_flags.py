"""--scheduling-policy and --priority-aging-seconds reach the settings, from flags or their variables, and bad
values are refused before anything starts."""

import pytest

from launcher.cli import settings_from
from libs.runtime.settings import Settings
from tests.launcher.serve_argv import parse


def test_scheduling_policy_flags(model_dir, monkeypatch):
    s = settings_from(parse(), model_dir)
    assert (s.scheduling_policy, s.priority_aging_s) == ("fcfs", 30.0)  # vLLM's default policy
    s = settings_from(parse("--scheduling-policy", "priority", "--priority-aging-seconds", "5"), model_dir)
    assert (s.scheduling_policy, s.priority_aging_s) == ("priority", 5.0)
    env = s.to_env()
    assert Settings.from_env(env).scheduling_policy == "priority"  # what the programs read
    monkeypatch.setenv("SCHEDULING_POLICY", "priority")  # the launcher's variable for the flag
    assert settings_from(parse(), model_dir).scheduling_policy == "priority"
    monkeypatch.setenv("SCHEDULING_POLICY", "lifo")  # argparse does not check a default against its choices
    with pytest.raises(SystemExit, match="--scheduling-policy must be fcfs or priority"):
        settings_from(parse(), model_dir)
    monkeypatch.delenv("SCHEDULING_POLICY")
    with pytest.raises(SystemExit, match="--priority-aging-seconds must be >= 0"):
        settings_from(parse("--priority-aging-seconds", "-1"), model_dir)
