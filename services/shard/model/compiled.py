"""The decoder walk compiled by inductor: the elementwise work between the oneDNN products fused into a few loops.

`CompiledWalk` walks the same modules and the same math as DecoderWalk (decoder_walk.py), with the two calls
dynamo cannot trace as custom ops (ops.py): each packed product (q/k/v and gate/up as one product, then split) and
each layer's paged attention. What lies between (RMSNorm's passes and casts, Gemma's q/k norms, rotary, SiLU × up,
residual adds) is fused by inductor.

Regional compile: the unit compiled is ONE decoder layer (`_layer`, a function of the residual stream, the rotary
tables, the layer's norm weights and its `_Kind`), and every layer of the same kind reuses its graph: the layer's
products and its index reach the ops through `ops.current`, not the graph. A model's layers are of one kind (Gemma's
sliding and global layers of two: their windows differ), so dynamo traces a layer or two instead of the whole stack,
and a start compiles (or loads from the cache) a graph or two. `graphs` counts what the compile at start traced. The
embedding, the rotary tables and the head (final norm and LM head of the kept positions) stay eager.

The token dimension is dynamic and unbacked (no specialization of 1): one graph per kind serves every step (decode
rows, prefill chunks, verified drafts; the row structure lives in the attention op's PagedBatch). `warm` compiles at
start and runs the row counts asked (`--compile-buckets`, a check that they need no other graph); a step that would
need a new graph later runs eagerly (`fail_on_recompile`) and is counted, so serving never stalls on a compile.
`counts` says which path every step took (compiled, or eager and why); the runner routes LoRA steps to eager itself
(the compiled layer calls the base products only).

Inductor's caches live in the model cache's `inductor/` folder (`use_cache_dir` chooses another): a second start
of the same model on the same CPU, torch and thread count loads its graphs instead of compiling them. Exactness:
inductor would carry a fused bf16 chain in float32 and round once; with its casts emulated it rounds where the eager
ops round, so the compiled bf16 logits are the eager walk's (equal on the tiny models, tested within tolerance);
float32 stays eager (`build` refuses it), bit-identical to transformers.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from libs.runtime import model_store
from services.shard.attention.paged import PagedBatch
from services.shard.model import ops
from services.shard.model.decoder_walk import DecoderWalk, _head_norm, _Layer, _norm

log = logging.getLogger(__name__)
# row counts compiled at start: the one-token graph and the dynamic one (every count from 2 on)
DEFAULT_BUCKETS = (1, 2)
# float32 is the exact mode (bit-identical to transformers), and compiling it does not pay where it is the default
# (docs/benchmarks.md); bench.step.compiled empties this to measure it
EAGER_DTYPES = (torch.float32,)


_cache_chosen = False  # use_cache_dir was called


def default_cache_dir() -> Path:
    """`inductor/` in the model cache (SWITCHYARD_CACHE, else ~/.cache/switchyard), where the embedded models live."""
    return model_store.cache_dir() / "inductor"


def _cache_dir() -> str:
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR", "inductor's default")


def use_cache_dir(path: str | Path) -> None:
    """Inductor's caches (FX graphs, kernels) under `path`; read by inductor when it first compiles."""
    global _cache_chosen
    Path(path).mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    _cache_chosen = True


@dataclass(frozen=True, slots=True)
class _Kind:
    """What a layer's graph is specialized on: its structure and constants. Layers with equal kinds share one
    graph (the walk keeps one instance per distinct kind: dynamo guards on it)."""

    gemma: bool  # sandwich norms, (1 + weight) in float32
    eps: tuple[float, float, float, float]  # norm_in, norm_mid, norm_attn_out, norm_mlp_out (Llama: the last two 0)
    qk_norm_eps: float | None  # Gemma-3's per-head q/k norms, else None
    head_dim: int
    qkv_widths: tuple[int, int, int]
    fused_qkv: bool  # one product for q/k/v (slot 0), else three (slots 0-2)
    hidden: int  # o's and down's output width
    inter: int
    fused_gate_up: bool
    act: object  # the activation function, one object per distinct function (`_canonical_act`)
    scaling: float
    softcap: float  # 0: none
    window: int  # 0: full attention


@dataclass(slots=True)
class _CompiledLayer:
    index: int
    kind: _Kind
    products: list[ops.Product]  # by slot: q/k/v (one or three), o, gate/up (one or two), down
    norms: tuple[torch.Tensor, ...]  # norm_in, norm_mid[, norm_attn_out, norm_mlp_out][, q_norm, k_norm]
    rope: str


def _packed(module: torch.nn.Module) -> ops.Product | None:
    """A lone packed oneDNN linear's product, or None when it is not one."""
    return getattr(module, "onednn_weight", None)


def _group(members: list[torch.nn.Module]) -> list[ops.Product] | None:
    """One product when the members are one fused oneDNN product in this order, else one per member (None: a member
    is not a packed oneDNN linear, e.g. quantized)."""
    product = getattr(members[0], "fused_product", None)
    if product is not None and all(getattr(m, "fused_product", None) is product for m in members):
        if not hasattr(product, "packed") or [m.fused_member for m in members] != list(range(len(members))):
            return None
        return [(product.packed, product.bias, product.out_features)]
    found = [_packed(m) for m in members]
    return None if None in found else found


def _canonical_act(act, seen: dict):
    """One object per activation function: a partial (GELU-tanh's) is a new object per layer, equal in what it calls."""
    if isinstance(act, functools.partial):
        key = (act.func, act.args, tuple(sorted(act.keywords.items())))
    else:
        key = act
    return seen.setdefault(key, act)


def _compiled_layer(s: _Layer, kinds: dict, acts: dict) -> _CompiledLayer | None:
    qkv = _group([s.q_proj, s.k_proj, s.v_proj])
    gate_up = _group([s.gate_proj, s.up_proj])
    o, down = _packed(s.o_proj), _packed(s.down_proj)
    if qkv is None or gate_up is None or o is None or down is None:
        return None
    gemma = s.norm_attn_out is not None
    norms = (s.norm_in, s.norm_mid) + ((s.norm_attn_out, s.norm_mlp_out) if gemma else ())
    kind = _Kind(
        gemma=gemma,
        eps=tuple(n[1] for n in norms) if gemma else (s.norm_in[1], s.norm_mid[1], 0.0, 0.0),
        qk_norm_eps=s.qk_norm[3] if s.qk_norm is not None else None,
        head_dim=s.head_dim,
        qkv_widths=(s.q_proj.out_features, s.k_proj.out_features, s.v_proj.out_features),
        fused_qkv=len(qkv) == 1,
        hidden=s.o_proj.out_features,
        inter=s.gate_proj.out_features,
        fused_gate_up=len(gate_up) == 1,
        act=_canonical_act(s.act, acts),
        scaling=s.scaling,
        softcap=float(s.softcap or 0.0),
        window=s.window,
    )
    weights = tuple(n[0] for n in norms) + ((s.qk_norm[0], s.qk_norm[1]) if s.qk_norm is not None else ())
    return _CompiledLayer(s.index, kinds.setdefault(kind, kind), [*qkv, o, *gate_up, down], weights, s.rope)


def unsupported(walk: DecoderWalk | None, dtype: torch.dtype) -> str:
    """Why this model's steps cannot be compiled ("" when they can)."""
    if walk is None:
        return "no decoder walk"
    if dtype in EAGER_DTYPES:
        return "float32 stays eager (bit-identical to transformers)"
    if any(_compiled_layer(s, {}, {}) is None for s in walk.layers):
        return "a linear is not a prepacked oneDNN product (quantized, or oneDNN off)"
    return ""


class CompiledWalk:
    """A DecoderWalk's layers compiled (module docstring); `forward` has DecoderWalk.forward's signature."""

    def __init__(self, walk: DecoderWalk) -> None:
        self.walk = walk
        kinds: dict = {}
        acts: dict = {}
        self.layers = [_compiled_layer(s, kinds, acts) for s in walk.layers]
        self.kinds = len(kinds)
        self.counts: Counter = Counter()  # "compiled", or "eager: <why>", per step (tests and the bench read it)
        self.compile_s = 0.0
        self.graphs = 0  # graphs dynamo traced at start: one per kind of layer, not one per layer
        # emulate_precision_casts: a fused chain rounds to bf16 where the eager ops round (the casts kept), so the
        # compiled layer gives the eager walk's values, not float32-carried ones. dynamic=False: only the marked
        # token dimension is dynamic; every other size and constant stays static (kernels of known widths), also
        # after another model's layers compiled in this process (no automatic dynamic: a kind is a graph)
        self._compiled = torch.compile(_layer, dynamic=False, fullgraph=True, options={"emulate_precision_casts": True})
        self._warm = False

    # -----------------------------------------------------------------------------------------------------------
    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor, paged: PagedBatch
    ) -> torch.Tensor:
        """[kept, vocab] logits of one packed step: the compiled layers, or the eager walk for a shape not compiled
        at start."""
        h = None
        if self._warm:
            try:
                with torch.compiler.set_stance("fail_on_recompile"):
                    h = self._body(input_ids, position_ids, paged, mark=False)
            except RuntimeError as e:
                if "recompil" not in str(e).lower():
                    raise
                self.counts["eager: a shape not compiled at start"] += 1
        else:
            self.counts["eager: not compiled yet"] += 1
        if h is None:  # the eager walk rewrites every layer's K/V: the same slots, the same step
            return self.walk.forward(input_ids, position_ids, keep, paged)
        self.counts["compiled"] += 1
        self.walk.forwards += 1
        return self.walk.head(h, keep)

    @torch.inference_mode()  # as the runner's steps run: the graphs are inference graphs, and guard on it
    def warm(self, step_for_rows) -> float:
        """Compile at start: one step of each row count in `step_for_rows` (rows -> (input_ids, position_ids,
        paged)); returns the seconds it took (logged)."""
        started = time.perf_counter()
        graphs = counters["stats"]["unique_graphs"]
        for input_ids, position_ids, paged in step_for_rows.values():
            self._body(input_ids, position_ids, paged, mark=True)
        self._warm = True
        self.graphs = counters["stats"]["unique_graphs"] - graphs
        self.compile_s = time.perf_counter() - started
        log.info(
            "compiled step: %d graph(s) for %d layers of %d kind(s), compiled at start in %.1f s (inductor cache: %s)",
            self.graphs, len(self.layers), self.kinds, self.compile_s, _cache_dir(),
        )  # fmt: skip
        return self.compile_s

    # -----------------------------------------------------------------------------------------------------------
    def _body(self, input_ids: torch.Tensor, position_ids: torch.Tensor, paged: PagedBatch, mark: bool):
        """The residual stream after the last layer: embedding and rotary tables eager, each layer compiled."""
        walk = self.walk
        h = walk.embed(input_ids)
        ropes = walk._ropes(h, position_ids)
        with ops.current.of(paged):
            for layer in self.layers:
                cos, sin = ropes[layer.rope]
                if mark:  # one graph for every token count, 1 included (a backed size would specialize 1); the
                    # three share one size (shape_id: one unbacked symbol)
                    for t in (h, cos, sin):
                        torch._dynamo.decorators.mark_unbacked(t, 0, shape_id="tokens")
                ops.current.at(layer.index, layer.products)
                h = self._compiled(layer.kind, h, cos, sin, layer.norms)
        return h


def _layer(kind: _Kind, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norms: tuple) -> torch.Tensor:
    """One decoder layer (DecoderWalk's `_llama_layer` / `_gemma_layer`) with the products and the attention as ops
    on the running layer (ops.current); returns the new residual stream."""
    linear = torch.ops.switchyard.onednn_linear
    T, D = h.shape[0], kind.head_dim
    qw, kw, vw = kind.qkv_widths  # sizes spelled out: T is unbacked, a -1 would need a guard on it
    x = _norm(h, (norms[0], kind.eps[0], kind.gemma))
    if kind.fused_qkv:
        q, k, v = linear(x, 0, qw + kw + vw).split(kind.qkv_widths, -1)
        slot = 1
    else:
        q, k, v = linear(x, 0, qw), linear(x, 1, kw), linear(x, 2, vw)
        slot = 3
    q, k, v = q.reshape(T, qw // D, D), k.reshape(T, kw // D, D), v.reshape(T, vw // D, D)
    if kind.qk_norm_eps is not None:
        q = _head_norm(q, norms[-2], kind.qk_norm_eps)
        k = _head_norm(k, norms[-1], kind.qk_norm_eps)
    q, k = _rotate_halves(q, cos, sin), _rotate_halves(k, cos, sin)
    a = torch.ops.switchyard.paged_attention(q, k, v, kind.scaling, kind.softcap, kind.window).reshape(T, qw)
    a = linear(a, slot, kind.hidden)
    h = h + (_norm(a, (norms[2], kind.eps[2], True)) if kind.gemma else a)
    x = _norm(h, (norms[1], kind.eps[1], kind.gemma))
    if kind.fused_gate_up:
        gate, up = linear(x, slot + 1, 2 * kind.inter).split((kind.inter, kind.inter), -1)
        down = slot + 2
    else:
        gate, up = linear(x, slot + 1, kind.inter), linear(x, slot + 2, kind.inter)
        down = slot + 3
    m = linear(kind.act(gate) * up, down, kind.hidden)
    return h + (_norm(m, (norms[3], kind.eps[3], True)) if kind.gemma else m)


def _rotate_halves(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """decoder_walk._rotate with the roll by half written as its two halves swapped (the same values; roll's
    empty-tensor check would guard on the unbacked token count)."""
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
