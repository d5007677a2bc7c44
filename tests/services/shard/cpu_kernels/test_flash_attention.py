"""The flash kernel of long prefill rows (services/shard/cpu_kernels/flash_attention.cpp) against the float32 math of
the same bf16 inputs: causal and sliding-window rows, with context before the queries, GQA, head dimensions of one
and several column slices, lengths that end mid-block; and a hidden key never reaches the output. It runs where
oneDNN's brgemm takes bf16 (a CPU with AMX); elsewhere the tiled path never calls it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.shard import cpu_kernels

pytestmark = pytest.mark.skipif(
    not (cpu_kernels.load() and torch.ops.switchyard_cpu.flash_attention_ready()),
    reason="the flash kernel needs oneDNN's bf16 brgemm (a CPU with AMX)",
)


def _visible(n: int, keys: int, q_pos: int, k_pos: int, window: int) -> torch.Tensor:
    qp = torch.arange(q_pos, q_pos + n)[:, None]
    kp = torch.arange(k_pos, k_pos + keys)[None, :]
    seen = kp <= qp
    return seen & (kp > qp - window) if window else seen


def _reference(q, k, v, q_pos, k_pos, window, scale) -> torch.Tensor:
    """[n, heads, D] float32: SDPA's math over the float32 values of the bf16 inputs."""
    mask = _visible(q.shape[1], k.shape[1], q_pos, k_pos, window)
    out = F.scaled_dot_product_attention(
        q.float()[None], k.float()[None], v.float()[None], attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def _row(heads, kv_heads, d, n, ctx, seed=0, token_major=False):
    g = torch.Generator().manual_seed(seed)
    # queries token-major as the model makes them, seen head-major (the tiled path's view)
    q = (torch.randn(n, heads, d, generator=g) * 2).bfloat16().transpose(0, 1)
    k = (torch.randn(kv_heads, ctx + n, d, generator=g) * 2).bfloat16()
    v = torch.randn(kv_heads, ctx + n, d, generator=g).bfloat16()
    if token_major:  # the step's own K/V as the model makes them ([tokens, kv_heads, D]), seen head-major
        k, v = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (k, v))
    return q, k, v


@pytest.mark.parametrize(
    "heads,kv_heads,d", [(9, 3, 64), (4, 1, 256), (2, 2, 32), (8, 2, 128), (4, 4, 96)]
)  # SmolLM2's and Gemma-3's heads; one slice of 32; 96 = a slice of 64 and one of 32
@pytest.mark.parametrize("window", [0, 37, 300])
@pytest.mark.parametrize("n,ctx,token_major", [(300, 0, False), (300, 0, True), (129, 77, False), (64, 500, False)])
def test_flash_attention_equals_the_float32_math(heads, kv_heads, d, window, n, ctx, token_major):
    q, k, v = _row(heads, kv_heads, d, n, ctx, token_major=token_major)
    assert k.stride(1) == (kv_heads if token_major else 1) * d  # token-major: a key's heads lie side by side
    k_pos = max(0, ctx - window + 1) if window else 0  # the keys start where the first query's window does
    k, v = k[:, k_pos:], v[:, k_pos:]
    out = torch.full((n, heads, d), float("nan"), dtype=torch.bfloat16)
    scale = d**-0.5
    torch.ops.switchyard_cpu.flash_attention(q, k, v, out, ctx, k_pos, window, scale)
    want = _reference(q, k, v, ctx, k_pos, window, scale)
    rounding = (want.bfloat16().float() - want).abs().max().item()  # what storing in bf16 alone costs
    assert (out.float() - want).abs().max().item() <= 2 * rounding + 2e-3
    if window and window < ctx + n:  # the window matters here: full attention gives other outputs
        full = _reference(q, k, v, ctx, k_pos, 0, scale)
        assert (full - want).abs().max().item() > 0.05


@pytest.mark.parametrize("window", [0, 600])
def test_scores_that_keep_rising_move_the_running_maximum(window):
    """Later keys score far above earlier ones: the last query's maximum grows by 25-120 in base 2 from its first
    256 visible keys (aligned as the kernel's key blocks are) to the rest, so a row's reference maximum must move
    past its slack of 8, and its sums be rescaled, more than once; the output is the float32 math still. Without
    the moves the probabilities would overflow."""
    heads, kv_heads, d, n = 4, 1, 64, 1400
    q, k, v = _row(heads, kv_heads, d, n, 0, seed=5)
    q = q.abs()  # every query leans the same way, so that a key's growing length raises every row's scores
    k = (k.float().abs() * torch.linspace(0.1, 4, n)[None, :, None]).bfloat16()
    out = torch.empty(n, heads, d, dtype=torch.bfloat16)
    torch.ops.switchyard_cpu.flash_attention(q, k, v, out, 0, 0, window, d**-0.5)
    want = _reference(q, k, v, 0, 0, window, d**-0.5)
    last = (q.float()[:, -1] @ k.float()[0].T) * d**-0.5 * 1.4427  # the last query's scores, base 2
    first = (n - window if window else 0) // 256 * 256
    assert (last[:, first:].amax(-1) - last[:, first : first + 256].amax(-1)).min().item() > 16
    rounding = (want.bfloat16().float() - want).abs().max().item()
    assert torch.isfinite(out.float()).all()
    assert (out.float() - want).abs().max().item() <= 2 * rounding + 2e-3


def test_a_jump_in_the_first_half_of_a_partly_seen_pair_moves_the_maximum():
    """In the diagonal block (seen in part), keys 256-271 score far above everything before them and keys 272-287
    do not: the block's maximum is in the first of the two vectors the softmax takes at a time, and must still move
    the row's reference, or its probabilities overflow."""
    heads, kv_heads, d, n = 1, 1, 64, 300
    q, k, v = _row(heads, kv_heads, d, n, 0, seed=7)
    q = torch.ones_like(q)  # every query the same direction
    k = k.float() * 0.1
    k[:, 256:272] = 20.0  # 231 in base 2 against ~1 before them: far past the slack, and past float's range
    k = k.bfloat16()
    out = torch.empty(n, heads, d, dtype=torch.bfloat16)
    torch.ops.switchyard_cpu.flash_attention(q, k, v, out, 0, 0, 0, d**-0.5)
    want = _reference(q, k, v, 0, 0, 0, d**-0.5)
    rounding = (want.bfloat16().float() - want).abs().max().item()
    assert torch.isfinite(out.float()).all()
    assert (out.float() - want).abs().max().item() <= 2 * rounding + 2e-3


def test_a_hidden_key_never_reaches_the_output():
    """Keys after a query and before its window hold huge values; the output is the float32 math all the same."""
    heads, kv_heads, d, n, ctx, window = 4, 2, 64, 200, 100, 50
    q, k, v = _row(heads, kv_heads, d, n, ctx, seed=3)
    out = torch.empty(n, heads, d, dtype=torch.bfloat16)
    torch.ops.switchyard_cpu.flash_attention(q, k, v, out, ctx, 0, window, d**-0.5)
    want = _reference(q, k, v, ctx, 0, window, d**-0.5)
    # the first query (position 100) sees keys 51..100: poison 0..50 and 101..: its row must not move
    poisoned = v.clone()
    poisoned[:, :51] = 1e4
    poisoned[:, 101:] = -1e4
    first = torch.empty_like(out)
    torch.ops.switchyard_cpu.flash_attention(q, k, poisoned, first, ctx, 0, window, d**-0.5)
    assert torch.equal(first[0], out[0])
    assert (out.float() - want).abs().max().item() < 0.02


@pytest.mark.parametrize(
    "bad,message",
    [
        (dict(k_pos=5), "the keys must run from k_pos"),  # keys starting after the first query
        (dict(d=48), "multiple of 32"),
        (dict(dtype=torch.float32), "bf16"),
    ],
)
def test_bad_arguments_are_refused(bad, message):
    d, dtype = bad.get("d", 64), bad.get("dtype", torch.bfloat16)
    q = torch.zeros(2, 10, d, dtype=dtype)
    k = v = torch.zeros(1, 10, d, dtype=dtype)
    out = torch.zeros(10, 2, d, dtype=dtype)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.switchyard_cpu.flash_attention(q, k, v, out, 0, bad.get("k_pos", 0), 0, 0.125)
