"""Start-up LoRA adapters under tensor parallel (`--num-shard 2 --lora-adapters ...`): each rank loads its slices
at start (B's rows of column-parallel layers, A's columns of row-parallel ones, whose shrink outputs are summed
over the ranks), and base rows and the adapters mixed in one concurrent batch equal peft's generate() token for
token; both ranks log the adapters and the scheduler counts the adapter tokens (the adapters really ran)."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.lora.test_archs import PROMPTS, ROWS, generate, reference_tokens
from tests.e2e.server import Server
from tests.e2e.test_generate import counter_now
from tests.lora_adapters import build_adapter

peft = pytest.importorskip("peft")

ADAPTERS = {
    # every projection, so both splits (column: q/k/v/gate/up, row: o/down) carry adapter weights
    "all": dict(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    ),
    "qv_mlp_rs": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "up_proj"]),
}


def test_start_up_adapters_on_two_ranks_equal_peft(tiny_model_dir, tmp_path):
    dirs = {name: build_adapter(tiny_model_dir, tmp_path / name, seed=90 + i, **cfg) for i, (name, cfg) in
            enumerate(ADAPTERS.items())}  # fmt: skip
    assert list(dirs) == ROWS[1:]  # reference_tokens's rows: the base model, then these
    want = reference_tokens(tiny_model_dir, dirs)
    flags = ["--lora-adapters", ",".join(f"{name}={path}" for name, path in dirs.items()), "--num-shard", "2"]
    with Server(tiny_model_dir, tmp_path / "server.log", *flags, "--max-total-tokens", "512",
                    "--max-input-tokens", "400") as server:  # fmt: skip
        # one start-up line per rank
        deadline = time.monotonic() + 30
        while len(re.findall(r"LoRA adapters loaded: all, qv_mlp_rs", server.log_path.read_text())) < 2:
            assert time.monotonic() < deadline, "both ranks did not log their start-up adapters"
            time.sleep(0.2)
        cases = [(text, name) for text in PROMPTS for name in ROWS]
        with ThreadPoolExecutor(len(cases)) as pool:
            got = dict(zip(cases, pool.map(lambda case: generate(server.url, *case), cases)))
        for case in cases:
            assert got[case] == want[case], f"adapter {case[1]!r} on prompt {case[0][:30]!r}"
        adapter_tokens = sum(len(v) for (_, name), v in got.items() if name)
        deadline = time.monotonic() + 30
        while counter_now(server.url, "lora_generated") < adapter_tokens:
            assert time.monotonic() < deadline, "the scheduler counted fewer adapter tokens than were generated"
            time.sleep(0.2)
