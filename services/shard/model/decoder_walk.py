"""A direct decoder walk: the model's own modules, walked with the least glue between their kernels.

For the architectures in ARCHS this walks the SAME modules as transformers' forward (the embedding, the q/k/v/o
and MLP linears with whatever `forward` is installed: oneDNN, LoRA, quantized; the rotary embedding, the LM head)
and does only the glue: norms by `torch.rms_norm` with the model's own dtype round trips (Llama: normalized in
float32, cast, times the weight; Gemma: times (1 + weight) in float32, then cast), bit-identical in every dtype;
rotary with rotate_half's sign folded into sin (exact; q and k in one pass when side by side); q/k/v as views;
the paged attention called directly (attend_layer); residual adds in place; the final norm on the kept positions
only. `build` decides at load: an ARCHS model of transformers' own classes, without bidirectional attention,
partial rotary or tensor parallel; anything else keeps transformers' forward, the reason logged and kept on the
runner (`walk_reason`). With `kernels` (half precision on CPU, the runner loaded services/shard/cpu_kernels/) the
same glue runs as C++ kernels: each residual add with the norm after it, q/k norms with the rotary, act(gate) × up.
docs/attention.md tells why.
"""

from __future__ import annotations

import functools
import logging
import warnings
from dataclasses import dataclass

import torch

from services.shard.attention.paged import PagedBatch, attend_layer

log = logging.getLogger(__name__)
# a half input with Gemma's float32 (1 + weight) takes rms_norm's composite path, which is the one we want (`_norm`)
warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")

# model class -> (module class prefix, norm kind, layout): "llama" layers are pre-norm; "gemma" layers add the
# sandwich norms (post-attention, pre/post feed-forward); "gemma3" adds per-head q/k norms and per-type rotary.
ARCHS = {
    "LlamaForCausalLM": ("Llama", "llama"),
    "Qwen2ForCausalLM": ("Qwen2", "llama"),
    "MistralForCausalLM": ("Mistral", "llama"),
    "Gemma2ForCausalLM": ("Gemma2", "gemma2"),
    "Gemma3ForCausalLM": ("Gemma3", "gemma3"),
    # Qwen2-VL's and Qwen2.5-VL's language models (services/shard/vision/qwen2_vl.py), M-RoPE positions
    "Qwen2VLCausalLM": ("Qwen2VL", "llama"),
    "Qwen2_5_VLCausalLM": ("Qwen2_5_VL", "llama"),
}


@dataclass(slots=True)
class _Layer:
    index: int
    norm_in: tuple  # (weight, eps) of each norm, as `_norm` takes it
    norm_mid: tuple  # before the MLP (Llama: post_attention_layernorm; Gemma: pre_feedforward_layernorm)
    norm_attn_out: tuple | None  # Gemma: post_attention_layernorm (applied to the attention's output)
    norm_mlp_out: tuple | None  # Gemma: post_feedforward_layernorm
    qk_norm: tuple | None  # Gemma-3's per-head q/k norms (`_layer_spec`)
    q_proj: torch.nn.Module
    k_proj: torch.nn.Module
    v_proj: torch.nn.Module
    o_proj: torch.nn.Module
    gate_proj: torch.nn.Module
    up_proj: torch.nn.Module
    down_proj: torch.nn.Module
    act: object
    head_dim: int
    scaling: float
    softcap: float | None
    window: int  # 0: full attention
    rope: str  # which of the step's rotary tables the layer uses


class DecoderWalk:
    """The model's decoder stack and LM head, walked with minimal glue; `forward` is the runner's `_forward`."""

    def __init__(self, model: torch.nn.Module, prefix: str, kind: str, kernels: bool = False) -> None:
        self.model, self.kind = model, kind
        body = model.model
        self.embed = body.embed_tokens
        self.rotary = body.rotary_emb
        gemma = kind != "llama"
        self.final_norm = _norm_spec(body.norm, gemma)
        self.lm_head = model.get_output_embeddings()
        self.final_softcap = getattr(model.config, "final_logit_softcapping", None)
        self.layer_types = getattr(model.config, "layer_types", None) if kind == "gemma3" else None
        self.layers = [_layer_spec(layer, i, kind, model.config) for i, layer in enumerate(body.layers)]
        self.forwards = 0  # steps run through this walk (tests read it)
        # the glue by the C++ kernels (services/shard/cpu_kernels/: the runner loaded them; half precision on CPU),
        # else by torch ops
        self.kernels = kernels
        self.activation = _kernel_act(self.layers[0].act) if self.layers else None  # None: the torch ops' act
        self.kernel_steps = 0  # steps whose glue ran in the kernels (tests read it)

    # -----------------------------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        keep: torch.Tensor,
        paged: PagedBatch,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[kept, vocab] logits of one packed step (input_ids, position_ids: [T]); `inputs_embeds` ([T, hidden]:
        a vision model's, images merged) instead of the ids' embeddings."""
        self.forwards += 1
        h = self.body(input_ids, position_ids, paged, inputs_embeds)
        return self.head(h, keep)

    def body(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        paged: PagedBatch,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The residual stream after the last layer, [T, hidden] (before the final norm). Each layer returns what it
        adds to the stream (its MLP's output, and the norm it takes first where the model has one); the next layer's
        first norm adds it, so that the add and the norm are one pass where the kernels serve."""
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        if self.kernels:
            h = h.contiguous()  # the norm kernel's residual stream: rows in place
            self.kernel_steps += 1
        ropes = self._ropes(h, position_ids)
        layer_fn = self._llama_layer if self.kind == "llama" else self._gemma_layer
        pending = None
        for spec in self.layers:
            pending = layer_fn(spec, h, ropes[spec.rope], paged, pending)
        if pending is not None:
            y, y_norm = pending
            h.add_(y if y_norm is None else _norm(y, y_norm))
        return h

    def head(self, h: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head of the kept positions (the norm is per position: norm, then keep, is the same)."""
        logits = self.lm_head(_norm(h.index_select(0, keep), self.final_norm))
        if self.final_softcap is not None:  # as Gemma's CausalLM: divide, tanh, multiply
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def _ropes(self, h: torch.Tensor, position_ids: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin with rotate_half's sign folded in), each [T, 1, D], per rotary table the layers use.
        `position_ids` [T], or [3, T] for M-RoPE (temporal, height, width: services/shard/vision/mrope.py)."""
        pos = position_ids[None] if position_ids.dim() == 1 else position_ids[:, None]
        if self.layer_types is None:
            tables = {"": self.rotary(h, pos)}
        else:
            tables = {t: self.rotary(h, pos, t) for t in set(self.layer_types)}
        out = {}
        for name, (cos, sin) in tables.items():
            half = sin.shape[-1] // 2
            signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
            out[name] = (cos[0, :, None], signed[0, :, None])
        return out

    # -----------------------------------------------------------------------------------------------------------
    def _llama_layer(self, s: _Layer, h: torch.Tensor, rope, paged: PagedBatch, pending) -> tuple:
        x = self._add_norm(h, pending, s.norm_in)
        x = self._add_norm(h, (s.o_proj(self._attention(s, x, rope, paged)), None), s.norm_mid)
        return s.down_proj(self._gated(s, x)), None

    def _gemma_layer(self, s: _Layer, h: torch.Tensor, rope, paged: PagedBatch, pending) -> tuple:
        x = self._add_norm(h, pending, s.norm_in)
        x = self._add_norm(h, (s.o_proj(self._attention(s, x, rope, paged)), s.norm_attn_out), s.norm_mid)
        return s.down_proj(self._gated(s, x)), s.norm_mlp_out

    def _add_norm(self, h: torch.Tensor, pending: tuple | None, spec: tuple) -> torch.Tensor:
        """h += y (y normed first by its own norm where given), in place; then h's norm by `spec`. `pending`: (y,
        y's norm or None), or None (nothing to add: the first layer)."""
        if self.kernels:
            y, y_norm = pending or (None, None)
            return torch.ops.switchyard_cpu.add_rms_norm(
                h,
                y,
                spec[0],
                spec[1],
                spec[2],
                None if y_norm is None else y_norm[0],
                0.0 if y_norm is None else y_norm[1],
            )
        if pending is not None:
            y, y_norm = pending
            h.add_(y if y_norm is None else _norm(y, y_norm))
        return _norm(h, spec)

    def _gated(self, s: _Layer, x: torch.Tensor) -> torch.Tensor:
        """act(gate(x)) * up(x): the kernel's one pass, or the torch ops with the product written into the
        activation's own fresh tensor (no third [T, inter] buffer; the same values)."""
        gate, up = s.gate_proj(x), s.up_proj(x)
        if self.kernels and self.activation is not None:
            return torch.ops.switchyard_cpu.gated(gate, up, self.activation)
        return s.act(gate).mul_(up)

    def _attention(self, s: _Layer, x: torch.Tensor, rope, paged: PagedBatch) -> torch.Tensor:
        """[T, heads * D]: q/k/v, their norms (Gemma-3) and rotary, the paged attention."""
        T, D = x.shape[0], s.head_dim
        q = s.q_proj(x)
        k = s.k_proj(x)
        v = s.v_proj(x).view(T, -1, D)
        heads = q.shape[-1] // D
        qk = _side_by_side(q, k, D)  # [T, heads + kv_heads, D] when the fused product made them neighbours
        if self.kernels:  # in place on the product's columns (this layer is their only reader)
            eps = 0.0 if s.qk_norm is None else s.qk_norm[3]
            parts = ((qk, 2),) if qk is not None else ((q.view(T, heads, D), 0), (k.view(T, -1, D), 1))
            for part, i in parts:
                weight = None if s.qk_norm is None else s.qk_norm[i]
                torch.ops.switchyard_cpu.rotary_(part, rope[0], rope[1], weight, eps)
            q, k = q.view(T, heads, D), k.view(T, -1, D)
        elif qk is not None:
            qk = _rotate(_qk_norm(qk, s.qk_norm, heads), rope)
            q, k = qk[:, :heads], qk[:, heads:]
        else:
            q, k = q.view(T, heads, D), k.view(T, -1, D)
            if s.qk_norm is not None:
                q = _head_norm(q, s.qk_norm[0], s.qk_norm[3])
                k = _head_norm(k, s.qk_norm[1], s.qk_norm[3])
            q, k = _rotate(q, rope), _rotate(k, rope)
        out = attend_layer(s.index, q, k, v, paged, s.scaling, s.softcap, s.window)
        return out.reshape(T, -1)


# ---------------------------------------------------------------------------------------------------------------
def _norm_spec(module: torch.nn.Module, gemma: bool) -> tuple:
    """(weight, eps, gemma): Gemma's (1 + weight) is formed once, in float32, as its forward forms it per call."""
    if gemma:
        return (1.0 + module.weight.detach().float(), float(module.eps), True)
    return (module.weight.detach(), float(module.variance_epsilon), False)


def _norm(x: torch.Tensor, spec: tuple) -> torch.Tensor:
    """transformers' RMSNorm of the model (module docstring), over the last dimension."""
    weight, eps, gemma = spec
    if gemma or x.dtype == torch.float32:
        # Gemma: normalized and weighted in float32, then cast: what rms_norm does with a half input and a float32
        # weight (it upcasts, multiplies, then casts back; tested bit-equal against transformers' forward)
        return torch.rms_norm(x, weight.shape, weight, eps)
    return torch.rms_norm(x, weight.shape, None, eps) * weight  # normalized in float32, cast, then the weight


def _head_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's per-head norm of [T, heads, D] with a per-head-row (1 + weight), [D] or [heads, D]."""
    if x.dtype == torch.float32:
        return torch.rms_norm(x, x.shape[-1:], None, eps) * weight
    return (torch.rms_norm(x.float(), x.shape[-1:], None, eps) * weight).to(x.dtype)


def _qk_norm(qk: torch.Tensor, spec: tuple | None, heads: int) -> torch.Tensor:
    """Gemma-3's q and k norms in one pass over q and k side by side (spec[2]: one weight row per head)."""
    return qk if spec is None else _head_norm(qk, spec[2], spec[3])


def _kernel_act(act) -> int | None:
    """The gated kernel's code for the activation function (0 SiLU, 1 GELU with tanh), None for any other."""
    if act is torch.nn.functional.silu:
        return 0
    if isinstance(act, functools.partial) and act.func is torch.nn.functional.gelu and not act.args:
        return 1 if act.keywords == {"approximate": "tanh"} else None
    return None


def _rotate(x: torch.Tensor, rope) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin, as x·cos + roll(x)·sin' (sin' carries rotate_half's sign)."""
    cos, signed_sin = rope
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * signed_sin


def _side_by_side(q: torch.Tensor, k: torch.Tensor, head_dim: int) -> torch.Tensor | None:
    """q and k as one [T, q + k heads, D] view when k's columns follow q's in the same rows (else None)."""
    if q.dim() != 2 or q.stride() != k.stride() or q.stride(1) != 1 or q.dtype != k.dtype:
        return None
    if k.data_ptr() != q.data_ptr() + q.shape[1] * q.element_size():
        return None
    if q.shape[1] + k.shape[1] > q.stride(0) and q.shape[0] > 1:
        return None
    heads = (q.shape[1] + k.shape[1]) // head_dim
    return q.as_strided((q.shape[0], heads, head_dim), (q.stride(0), head_dim, 1))


def _activation(module: torch.nn.Module):
    """The function the activation module's forward calls (no module call per layer), or the module itself."""
    name = type(module).__name__
    if name == "SiLUActivation" or (type(module) is torch.nn.SiLU and not module.inplace):
        return torch.nn.functional.silu
    if name == "GELUTanh" and callable(getattr(module, "act", None)):
        return module.act  # functools.partial(gelu, approximate="tanh") (or its Python form), as forward calls it
    return module


def _layer_spec(layer, index: int, kind: str, config) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    gemma = kind != "llama"
    window = getattr(attn, "sliding_window", None)
    if kind == "llama" and window is None and type(attn).__name__ == "MistralAttention":
        window = getattr(config, "sliding_window", None)  # Mistral: every layer slides by the config's window
    qk_norm = None
    if kind == "gemma3":  # (q's, k's, both stacked per head row [heads + kv_heads, D], eps), as `_norm_spec` forms
        q_w, k_w = (1.0 + norm.weight.detach().float() for norm in (attn.q_norm, attn.k_norm))
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        stacked = torch.cat((q_w.expand(heads, -1), k_w.expand(kv_heads, -1)))
        qk_norm = (q_w, k_w, stacked, float(attn.q_norm.eps))
    return _Layer(
        index=index,
        norm_in=_norm_spec(layer.input_layernorm, gemma),
        norm_mid=_norm_spec(layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm, gemma),
        norm_attn_out=_norm_spec(layer.post_attention_layernorm, True) if gemma else None,
        norm_mlp_out=_norm_spec(layer.post_feedforward_layernorm, True) if gemma else None,
        qk_norm=qk_norm,
        q_proj=attn.q_proj,
        k_proj=attn.k_proj,
        v_proj=attn.v_proj,
        o_proj=attn.o_proj,
        gate_proj=mlp.gate_proj,
        up_proj=mlp.up_proj,
        down_proj=mlp.down_proj,
        act=_activation(mlp.act_fn),
        head_dim=attn.head_dim,
        scaling=float(attn.scaling),
        softcap=getattr(attn, "attn_logit_softcapping", None),
        window=int(window or 0),
        rope=(attn.layer_type or "") if kind == "gemma3" else "",
    )


def unsupported(model: torch.nn.Module, tp: int = 1) -> str:
    """Why this model keeps transformers' forward ("" when the decoder walk handles it)."""
    name = type(model).__name__
    if name not in ARCHS:
        return f"architecture {name} has no decoder walk"
    prefix, kind = ARCHS[name]
    if tp > 1:
        return "tensor parallel keeps transformers' forward"
    body, config = model.model, model.config
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    expected = {f"{prefix}DecoderLayer", f"{prefix}Attention", f"{prefix}MLP", f"{prefix}RMSNorm"}
    for module in body.layers.modules():
        cls = type(module)
        if cls.__name__.startswith(prefix) and (cls.__name__ not in expected or "transformers." not in cls.__module__):
            return f"module {cls.__module__}.{cls.__name__} is not transformers' own"
    for layer in body.layers:
        if type(layer).__name__ != f"{prefix}DecoderLayer" or not getattr(layer.self_attn, "is_causal", True):
            return "a layer is not a causal decoder layer of the architecture"
    if len(body.layers) != config.num_hidden_layers:
        return "the model has more layers than it runs"
    head_dim = body.layers[0].self_attn.head_dim
    probe = torch.zeros(1, 1, dtype=body.embed_tokens.weight.dtype, device=body.embed_tokens.weight.device)
    pos = torch.zeros(1, 1, dtype=torch.long, device=probe.device)
    types = sorted(set(config.layer_types)) if kind == "gemma3" else [None]
    for t in types:
        cos, _ = body.rotary_emb(probe, pos) if t is None else body.rotary_emb(probe, pos, t)
        if cos.shape[-1] != head_dim:
            return f"partial rotary ({cos.shape[-1]} of {head_dim} dims)"
    return ""


def build(
    model: torch.nn.Module, tp: int = 1, enabled: bool = True, kernels: bool = False
) -> tuple[DecoderWalk | None, str]:
    """The decoder walk for this model, or None and why not (logged once, at load). `enabled` False
    (Settings.decoder_walk, SWITCHYARD_DECODER_WALK=0: to compare the two forwards end to end) keeps transformers'
    forward. `kernels`: the glue by the C++ kernels (loaded by the caller)."""
    reason = "turned off" if not enabled else unsupported(model, tp)
    if reason:
        log.info("forward: transformers' own (%s)", reason)
        return None, reason
    prefix, kind = ARCHS[type(model).__name__]
    log.info(
        "forward: decoder walk of the %s decoder (%s), glue by %s",
        kind, type(model).__name__, "the C++ kernels" if kernels else "torch ops",
    )  # fmt: skip
    return DecoderWalk(model, prefix, kind, kernels), ""
