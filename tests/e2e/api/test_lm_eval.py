"""lm-evaluation-harness as a real client: its `local-completions` model runs a tiny local loglikelihood task
(tests/data/lm_eval, no Hub) against the tiny model server, and every loglikelihood it records equals
transformers' float32 eager reference, as does its greedy flag.

lm-eval (with its `api` extra) is pinned in the `test` extra, so `make test` runs this. LM_EVAL_PYTHON points it
at another interpreter that has lm_eval; it is skipped only where neither has it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.reference import load_model

TASKS = Path(__file__).resolve().parents[2] / "data" / "lm_eval"
LM_EVAL_PYTHON = os.environ.get("LM_EVAL_PYTHON") or (sys.executable if importlib.util.find_spec("lm_eval") else None)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        LM_EVAL_PYTHON is None,
        reason="lm_eval is not importable (the test extra has it; LM_EVAL_PYTHON names another python)",
    ),
]


def test_local_completions_loglikelihoods(tiny_server, tiny_model_dir, tiny_tokenizer, tmp_path):
    args = ",".join(
        (
            "model=tgi",
            f"base_url={tiny_server.url}/v1/completions",
            f"tokenizer={tiny_model_dir}",
            "tokenized_requests=True",
            "num_concurrent=2",
            "max_retries=1",
        )
    )
    cmd = [LM_EVAL_PYTHON, "-m", "lm_eval", "--model", "local-completions", "--model_args", args]
    cmd += ["--tasks", "switchyard_tiny", "--include_path", str(TASKS), "--output_path", str(tmp_path)]
    cmd += ["--log_samples", "--batch_size", "1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run(cmd, cwd=TASKS, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (samples,) = tmp_path.rglob("samples_switchyard_tiny_*.jsonl")
    model = load_model(str(tiny_model_dir))
    checked = 0
    for line in samples.read_text().splitlines():
        doc = json.loads(line)
        for (context, continuation), (resp,) in zip(
            [(a["arg_0"], a["arg_1"]) for a in doc["arguments"].values()], doc["resps"]
        ):
            whole = tiny_tokenizer(context + continuation, add_special_tokens=False).input_ids
            ctxlen = len(tiny_tokenizer(context, add_special_tokens=False).input_ids)
            with torch.inference_mode():
                lps = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
            want = sum(lps[i - 1, whole[i]].item() for i in range(ctxlen, len(whole)))
            greedy = all(int(lps[i - 1].argmax()) == whole[i] for i in range(ctxlen, len(whole)))
            assert float(resp[0]) == pytest.approx(want, abs=1e-3), (context, continuation)
            assert (str(resp[1]) == "True") == greedy, (context, continuation)
            checked += 1
    assert checked == 9
