"""The pipeline breakdown (bench/serving/pipeline.py): the step's parts from /metrics deltas, a server's processes
and their CPU from /proc."""

import subprocess
import sys
import time

from bench.serving import pipeline


def test_breakdown_per_step_from_metric_deltas():
    steps = 10.0
    delta = {
        'switchyard_step_duration_seconds_sum{phase="forward"}': 0.250,  # sent → result, 25 ms a step
        'switchyard_step_duration_seconds_sum{phase="plan"}': 0.002,
        'switchyard_step_duration_seconds_sum{phase="sample"}': 0.003,
        'switchyard_step_duration_seconds_sum{phase="publish"}': 0.004,
        'switchyard_step_duration_seconds_count{phase="plan"}': 10.0,  # counts are not parts
        'tgi_batch_forward_duration_sum{method="decode"}': 0.180,
        'tgi_batch_forward_duration_count{method="decode"}': 9.0,  # 9 decode steps, 20 ms each
        'tgi_batch_forward_duration_sum{method="prefill"}': 0.040,
        pipeline.STEPS: steps,
    }
    b = pipeline.breakdown(delta, steps)
    assert round(b["shard_forward_ms"], 6) == 22.0
    assert round(b["shard_wait_ms"], 6) == 3.0  # 25 ms out, 22 of them the shard's own
    assert round(b["decode_forward_ms"], 6) == 20.0  # the decode steps alone, as the in-process limit's
    assert (round(b["plan_ms"], 6), round(b["apply_ms"], 6), round(b["publish_ms"], 6)) == (0.2, 0.3, 0.4)


def test_process_tree_names_roles_and_reads_cpu():
    child = subprocess.Popen([sys.executable, "-m", "json.tool"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    try:
        roles = pipeline.process_tree(child.pid)
        assert roles == {child.pid: "json.tool"}
        # once it blocks reading stdin it has been switched out at least once (until then it may have run unbroken)
        deadline = time.monotonic() + 30
        while (reading := pipeline.cpu_and_switches(child.pid))[1] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        cpu, switches = reading
        assert cpu > 0.0 and switches > 0
    finally:
        child.communicate(b"{}")
    assert pipeline.cpu_and_switches(child.pid) == (0.0, 0)  # gone (reaped)
