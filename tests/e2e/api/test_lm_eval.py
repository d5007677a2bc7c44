"""lm-evaluation-harness as a real client: its `local-completions` model runs a tiny local loglikelihood task
(tests/data/lm_eval, no Hub) against the tiny model server, and every loglikelihood it records equals
transformers' float32 eager reference, as does its greedy flag. Its `local-chat-completions` model runs a tiny
`generate_until` task with `--apply_chat_template` against /v1/chat/completions, every answer equal to
transformers' greedy generate() on the chat-rendered prompt, cut at the task's `until` as lm-eval cuts it.

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

from tests.reference import load_model, reference_generate

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


def answer(tokenizer, ids: list[int], until: list[str]) -> str:
    """The ids' text as the server sends it (special tokens and incomplete UTF-8 left out), cut as lm-eval cuts
    an answer: everything before the first of each stop string."""
    text = tokenizer.decode(ids, skip_special_tokens=True).replace("\ufffd", "")
    for term in until:
        text = text.split(term)[0]
    return text


def test_local_chat_completions_generate_until(tiny_server, tiny_model_dir, tiny_tokenizer, tmp_path):
    """Every answer equals transformers' greedy generate() on the chat-rendered prompt, cut as lm-eval cuts it; the
    same on the bare context differs for some, so the requests really went through the chat template."""
    args = f"model=tgi,base_url={tiny_server.url}/v1/chat/completions,num_concurrent=2,max_retries=1"
    cmd = [LM_EVAL_PYTHON, "-m", "lm_eval", "--model", "local-chat-completions", "--model_args", args]
    cmd += ["--tasks", "switchyard_tiny_gen", "--include_path", str(TASKS), "--output_path", str(tmp_path)]
    cmd += ["--log_samples", "--apply_chat_template"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run(cmd, cwd=TASKS, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (samples,) = tmp_path.rglob("samples_switchyard_tiny_gen_*.jsonl")
    until, differs, checked = ["\n", "."], 0, 0
    for line in samples.read_text().splitlines():
        doc = json.loads(line)
        context = doc["doc"]["context"]
        (got,) = doc["filtered_resps"]
        chat = tiny_tokenizer.apply_chat_template(
            [{"role": "user", "content": context}], add_generation_prompt=True, tokenize=False
        )
        ids = tiny_tokenizer(chat, add_special_tokens=False).input_ids
        want = answer(tiny_tokenizer, reference_generate(tiny_model_dir, ids, 8), until)
        assert got == want, (context, got, want)
        bare = tiny_tokenizer(context).input_ids
        differs += answer(tiny_tokenizer, reference_generate(tiny_model_dir, bare, 8), until) != want
        checked += 1
    assert checked == 3 and differs > 0
