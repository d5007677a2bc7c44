"""Runs one step plan: per-sequence state, the paged KV cache, one packed forward, sampling.

The scheduler decides everything (which rows, which blocks); the runner only keeps what it was told: each
sequence's sampling parameters, its seeded generator and its block table. A step is ONE forward over all rows
packed into [1, T] — prefills and decodes mixed — with position ids restarting per row, and the batch layout
(slots, row bounds) handed to `paged_attention` as the `paged` model kwarg.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from libs.protocol.messages import SamplingParams, StepPlan, StepResult
from services.shard.attention import ATTN_IMPLEMENTATION, PagedBatch
from services.shard.sampling import sample


@dataclass
class _Sequence:
    sampling: SamplingParams
    generator: torch.Generator
    blocks: list[int] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model_dir: str,
        *,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
        ).to(self.device)
        self.model.eval()
        cfg = self.model.config.get_text_config()
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        # Per layer K and V: block-major, so a block id picks a contiguous [block_size, kv_heads, head_dim] page.
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(self.num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(self.num_layers)]
        # the attention function addresses slots: flat views of the same memory
        self._flat_kv = [
            (k.view(-1, self.num_kv_heads, self.head_dim), v.view(-1, self.num_kv_heads, self.head_dim))
            for k, v in zip(self.k_cache, self.v_cache)
        ]
        self.seqs: dict[int, _Sequence] = {}

    @property
    def bytes_per_block(self) -> int:
        """KV memory of one block over all layers (K and V), for sizing `num_blocks`."""
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    # ---------------------------------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        """Apply the plan's diff, run its rows in one forward, return one sampled token per `sample` row."""
        t0 = time.perf_counter()
        fed = set() if plan.seqs is None else {int(s) for s in plan.seqs}
        # A finished seq not fed this step goes first (its handle may be reused by `new` in the same plan);
        # one that is still fed is dropped after the forward.
        for seq in plan.finished:
            if seq not in fed:
                self.seqs.pop(seq, None)
        for new in plan.new:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(int(new.sampling.seed))
            self.seqs[new.seq] = _Sequence(new.sampling, gen)
        for seq, blocks in plan.blocks.items():
            self._seq(seq).blocks.extend(int(b) for b in blocks)

        seqs = np.zeros(0, np.int32)
        token_ids = np.zeros(0, np.int32)
        logprobs = np.zeros(0, np.float32)
        if fed:
            seqs, token_ids, logprobs = self._step(plan)
        for seq in plan.finished:
            if seq in fed:
                self.seqs.pop(seq, None)
        return StepResult(
            step=plan.step,
            seqs=seqs,
            token_ids=token_ids,
            logprobs=logprobs,
            forward_s=time.perf_counter() - t0,
        )

    def _seq(self, seq: int) -> _Sequence:
        try:
            return self.seqs[seq]
        except KeyError:
            raise ValueError(f"plan refers to unknown sequence {seq}") from None

    @torch.inference_mode()
    def _step(self, plan: StepPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        seqs = np.asarray(plan.seqs, dtype=np.int64)
        num_tokens = np.asarray(plan.num_tokens, dtype=np.int64)
        context_lens = np.asarray(plan.context_lens, dtype=np.int64)
        sample_rows = np.asarray(plan.sample, dtype=bool)
        cu = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(num_tokens, out=cu[1:])
        if int(cu[-1]) != len(plan.token_ids) or (num_tokens < 1).any():
            raise ValueError("plan rows do not match its token ids")
        # position of every fed token: its row's context length + its index within the row
        positions = np.arange(cu[-1]) - np.repeat(cu[:-1], num_tokens) + np.repeat(context_lens, num_tokens)

        bs = self.block_size
        row_slots, new_slots, tables = [], [], []
        for i, seq in enumerate(seqs.tolist()):
            table = np.asarray(self._seq(seq).blocks, dtype=np.int64)
            length = int(context_lens[i] + num_tokens[i])
            if len(table) * bs < length:
                raise ValueError(f"sequence {seq} needs {length} slots but has {len(table)} blocks of {bs}")
            pos = np.arange(length)
            slots = table[pos // bs] * bs + pos % bs  # slot of position p: table[p // bs] * bs + p % bs
            row_slots.append(slots)
            new_slots.append(slots[length - num_tokens[i] :])
            tables.append(table)
        block_tables = np.full((len(tables), max(len(t) for t in tables)), -1, dtype=np.int32)
        for i, t in enumerate(tables):
            block_tables[i, : len(t)] = t

        dev = self.device
        batch = PagedBatch(
            kv_cache=self._flat_kv,
            slot_mapping=torch.from_numpy(np.concatenate(new_slots)).to(dev),
            cu_seqlens_q=torch.from_numpy(cu.astype(np.int32)).to(dev),
            context_lens=torch.from_numpy(context_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            row_bounds=[(int(cu[i]), int(cu[i + 1]), int(context_lens[i])) for i in range(len(seqs))],
            row_slots=[torch.from_numpy(s).to(dev) for s in row_slots],
        )
        input_ids = torch.from_numpy(np.asarray(plan.token_ids, dtype=np.int64)).to(dev)[None]
        position_ids = torch.from_numpy(positions).to(dev)[None]
        # only the last position of each sampled row reaches the LM head
        keep = torch.from_numpy(cu[1:][sample_rows] - 1).to(dev)
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=keep,
            paged=batch,
        )
        sampled = seqs[sample_rows]
        states = [self.seqs[int(s)] for s in sampled]
        ids, lps = sample(out.logits[0].float(), [s.sampling for s in states], [s.generator for s in states])
        return (
            sampled.astype(np.int32),
            ids.cpu().numpy().astype(np.int32),
            lps.cpu().numpy().astype(np.float32),
        )
