"""The decoder walk compiled by inductor: the elementwise work between the oneDNN products fused into a few loops.

`CompiledWalk` walks the same modules and the same math as DecoderWalk (decoder_walk.py), with the two calls
dynamo cannot trace as custom ops (ops.py): each packed product (q/k/v and gate/up as one product, then split) and
each layer's paged attention. What lies between (RMSNorm's passes and casts, Gemma's q/k norms, rotary, SiLU × up,
residual adds) is traced once and fused by inductor. The body (embedding to the last layer's residual) is compiled;
the head (final norm and LM head of the kept positions) stays eager: one norm over few rows, and no second dynamic
size in the graph.

The token dimension is dynamic and unbacked (no specialization of 1): ONE graph serves every step (decode rows,
prefill chunks, verified drafts; the row structure lives in the attention op's PagedBatch). `warm` compiles it at
start and runs it on the row counts asked (`--compile-buckets`, a check that they need no other graph); a step that
would need a new graph later runs eagerly (`fail_on_recompile`) and is counted, so serving never stalls on a
compile. `counts` says which path every step took (compiled, or eager and why); the runner routes LoRA steps to
eager itself (the compiled body calls the base products only).

Inductor's caches live in the model cache's `inductor/` folder (`use_cache_dir` chooses another): a second start
of the same model on the same CPU, torch and thread count loads its graph instead of compiling it. Exactness:
inductor would carry a fused bf16 chain in float32 and round once; with its casts emulated it rounds where the eager
ops round, so the compiled bf16 logits are the eager walk's (equal on the tiny models, tested within tolerance);
float32 stays eager (`build` refuses it), bit-identical to transformers.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from libs.runtime.settings import env_value
from services.shard.attention.paged import PagedBatch
from services.shard.model import ops
from services.shard.model.decoder_walk import DecoderWalk, _head_norm, _Layer, _norm

log = logging.getLogger(__name__)
# row counts compiled at start: the one-token graph and the dynamic one (every count from 2 on)
DEFAULT_BUCKETS = (1, 2)


_cache_chosen = False  # use_cache_dir was called


def default_cache_dir() -> Path:
    """`inductor/` in the model cache (SWITCHYARD_CACHE, else ~/.cache/switchyard), where the embedded models live."""
    root = env_value("cache") or Path.home() / ".cache" / "switchyard"
    return Path(root).expanduser() / "inductor"


def _cache_dir() -> str:
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR", "inductor's default")


def use_cache_dir(path: str | Path) -> None:
    """Inductor's caches (FX graphs, kernels) under `path`; read by inductor when it first compiles."""
    global _cache_chosen
    Path(path).mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    _cache_chosen = True


@dataclass(slots=True)
class _Products:
    """A layer's products as indices into the walk's table (ops.current.products), with the column widths each fused
    product splits into."""

    qkv: tuple[int, ...]  # one index (fused q/k/v) or three
    qkv_widths: tuple[int, int, int]
    o: int
    gate_up: tuple[int, ...]  # one index (fused gate/up) or two
    inter: int
    down: int


def _index_of(module: torch.nn.Module, seen: dict) -> int | None:
    """The table index of a lone packed linear (added on first sight), or None when it is not one."""
    weight = getattr(module, "onednn_weight", None)
    if weight is None:
        return None
    return _add(seen, module, weight)


def _add(seen: dict, owner, product: ops.Product) -> int:
    """`seen` maps id(owner) -> index and keeps the table in "table": the walk's products in the order first met."""
    if id(owner) not in seen:
        table = seen.setdefault("table", [])
        seen[id(owner)] = len(table)
        table.append(product)
    return seen[id(owner)]


def _group(members: list[torch.nn.Module], seen: dict) -> tuple[int, ...] | None:
    """One index when the members are one fused oneDNN product in this order, else one per member (None: a member
    is not a packed oneDNN linear, e.g. quantized)."""
    product = getattr(members[0], "fused_product", None)
    if product is not None and all(getattr(m, "fused_product", None) is product for m in members):
        if not hasattr(product, "packed") or [m.fused_member for m in members] != list(range(len(members))):
            return None
        return (_add(seen, product, (product.packed, product.bias, product.out_features)),)
    indices = tuple(_index_of(m, seen) for m in members)
    return None if None in indices else indices


def unsupported(walk: DecoderWalk | None, dtype: torch.dtype) -> str:
    """Why this model's steps cannot be compiled ("" when they can)."""
    if walk is None:
        return "no decoder walk"
    if dtype == torch.float32:
        return "float32 stays eager (bit-identical to transformers)"
    seen: dict = {}
    for s in walk.layers:
        if _products(s, seen) is None:
            return "a linear is not a prepacked oneDNN product (quantized, or oneDNN off)"
    return ""


def _products(s: _Layer, seen: dict) -> _Products | None:
    qkv = _group([s.q_proj, s.k_proj, s.v_proj], seen)
    gate_up = _group([s.gate_proj, s.up_proj], seen)
    o, down = _index_of(s.o_proj, seen), _index_of(s.down_proj, seen)
    if qkv is None or gate_up is None or o is None or down is None:
        return None
    widths = (s.q_proj.out_features, s.k_proj.out_features, s.v_proj.out_features)
    return _Products(qkv, widths, o, gate_up, s.gate_proj.out_features, down)


class CompiledWalk:
    """A DecoderWalk's body compiled (module docstring); `forward` has DecoderWalk.forward's signature."""

    def __init__(self, walk: DecoderWalk) -> None:
        self.walk = walk
        seen: dict = {}
        self.products = [_products(s, seen) for s in walk.layers]
        self.table: list[ops.Product] = seen.get("table", [])
        self.counts: Counter = Counter()  # "compiled", or "eager: <why>", per step (tests and the bench read it)
        self.compile_s = 0.0
        # emulate_precision_casts: a fused chain rounds to bf16 where the eager ops round (the casts kept), so the
        # compiled body gives the eager walk's values, not float32-carried ones
        self._compiled = torch.compile(
            self._body, dynamic=True, fullgraph=True, options={"emulate_precision_casts": True}
        )
        self._warm = False

    # -----------------------------------------------------------------------------------------------------------
    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor, paged: PagedBatch
    ) -> torch.Tensor:
        """[kept, vocab] logits of one packed step: the compiled body, or the eager walk for a shape not compiled at
        start."""
        h = None
        if self._warm:
            try:
                with ops.current.of(self.table, paged), torch.compiler.set_stance("fail_on_recompile"):
                    h = self._compiled(input_ids, position_ids)
            except RuntimeError as e:
                if "recompil" not in str(e).lower():
                    raise
                self.counts["eager: a shape not compiled at start"] += 1
        else:
            self.counts["eager: not compiled yet"] += 1
        if h is None:
            return self.walk.forward(input_ids, position_ids, keep, paged)
        self.counts["compiled"] += 1
        self.walk.forwards += 1
        return self.walk.head(h, keep)

    @torch.inference_mode()  # as the runner's steps run: the graphs are inference graphs, and guard on it
    def warm(self, step_for_rows) -> float:
        """Compile at start: one step of each row count in `step_for_rows` (rows -> (input_ids, position_ids,
        paged)); returns the seconds it took (logged)."""
        started = time.perf_counter()
        for input_ids, position_ids, paged in step_for_rows.values():
            # one graph for every token count, 1 included (a backed size would specialize 1)
            torch._dynamo.decorators.mark_unbacked(input_ids, 0)
            torch._dynamo.decorators.mark_unbacked(position_ids, 0)
            with ops.current.of(self.table, paged):
                self._compiled(input_ids, position_ids)
        self._warm = True
        self.compile_s = time.perf_counter() - started
        log.info("compiled step: compiled at start in %.1f s (inductor's cache: %s)", self.compile_s, _cache_dir())
        return self.compile_s

    # -----------------------------------------------------------------------------------------------------------
    def _body(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        walk = self.walk
        h = walk.embed(input_ids)
        ropes = walk._ropes(h, position_ids)
        gemma = walk.kind != "llama"
        for s, p in zip(walk.layers, self.products):
            rope = ropes[s.rope]
            x = _norm(h, s.norm_in)
            a = torch.ops.switchyard.onednn_linear(self._attention(s, p, x, rope), p.o)
            h = h + (_norm(a, s.norm_attn_out) if gemma else a)
            x = _norm(h, s.norm_mid)
            if len(p.gate_up) == 1:
                gate, up = torch.ops.switchyard.onednn_linear(x, p.gate_up[0]).split((p.inter, p.inter), -1)
            else:
                gate, up = (torch.ops.switchyard.onednn_linear(x, i) for i in p.gate_up)
            m = torch.ops.switchyard.onednn_linear(s.act(gate) * up, p.down)
            h = h + (_norm(m, s.norm_mlp_out) if gemma else m)
        return h

    def _attention(self, s: _Layer, p: _Products, x: torch.Tensor, rope) -> torch.Tensor:
        T, D = x.shape[0], s.head_dim
        if len(p.qkv) == 1:
            q, k, v = torch.ops.switchyard.onednn_linear(x, p.qkv[0]).split(p.qkv_widths, -1)
        else:
            q, k, v = (torch.ops.switchyard.onednn_linear(x, i) for i in p.qkv)
        qw, kw, vw = p.qkv_widths  # sizes spelled out: T is unbacked, a -1 would need a guard on it
        q, k, v = q.reshape(T, qw // D, D), k.reshape(T, kw // D, D), v.reshape(T, vw // D, D)
        if s.qk_norm is not None:
            q = _head_norm(q, s.qk_norm[0], s.qk_norm[3])
            k = _head_norm(k, s.qk_norm[1], s.qk_norm[3])
        q, k = _rotate_halves(q, rope), _rotate_halves(k, rope)
        out = torch.ops.switchyard.paged_attention(q, k, v, s.index, s.scaling, s.softcap or 0.0, s.window)
        return out.reshape(T, qw)


def _rotate_halves(x: torch.Tensor, rope) -> torch.Tensor:
    """decoder_walk._rotate with the roll by half written as its two halves swapped (the same values; roll's
    empty-tensor check would guard on the unbacked token count)."""
    cos, signed_sin = rope
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), -1) * signed_sin


def build(walk: DecoderWalk | None, dtype: torch.dtype, enabled: bool) -> tuple[CompiledWalk | None, str]:
    """The compiled walk, or None and why not (logged once, at load)."""
    reason = "turned off (--no-compile)" if not enabled else unsupported(walk, dtype)
    if reason:
        log.info("compiled step: off (%s)", reason)
        return None, reason
    if not _cache_chosen:  # a test or a benchmark may have chosen one (torch sets the variable itself when unset)
        use_cache_dir(default_cache_dir())
    return CompiledWalk(walk), ""
