"""Runs one step plan: per-sequence state, the paged KV cache, one packed forward, sampling.

The scheduler decides everything (which rows, which blocks); the runner only keeps what it was told: each
sequence's sampling parameters, its seeded generator, its block table and, for the sequences that need them, the
token ids it was fed (penalties, watermark) and the last prompt chunk's log-softmax (prompt logprobs). A step is
ONE forward over all rows packed into [1, T] — prefills and decodes mixed — with position ids restarting per row
and the batch layout (slots, row bounds) in a PagedBatch: the decoder walk's (services/shard/model/decoder_walk.py)
where the architecture has one, else transformers' forward with it as the `paged` kwarg of `paged_attention`.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

from libs.protocol.step_messages import StepPlan, StepResult
from libs.runtime import model_store
from services.shard import cpu_kernels as kernels_module
from services.shard import graphs as graphs_module
from services.shard.attention.kv_pages import allocate_pages
from services.shard.attention.paged import ATTN_IMPLEMENTATION, PagedBatch, attention_backend
from services.shard.grammar.runner import ShardGrammars
from services.shard.lora.registry import LoraRegistry
from services.shard.model import compiled as compiled_module
from services.shard.model import decoder_walk as walk_module
from services.shard.model.onednn import use_onednn
from services.shard.prompt_logprobs import chunk_greedy, chunk_logprobs
from services.shard.quant.loader import from_pretrained as quantized_from_pretrained
from services.shard.sampling.counter import DrawKeys
from services.shard.sampling.sampler import Choice, choose
from services.shard.step_batch import Batch, History, SequenceState
from services.shard.verify import PickGenerators, accept, expand_picks, kept_positions, select
from services.shard.vision import loader as vision_loader
from services.shard.vision.cache import merge
from services.shard.vision.image_state import ImageState


class ModelRunner:
    def __init__(
        self,
        model_dir: str | None,
        *,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        watermark_gamma: float = 0.5,
        watermark_delta: float = 2.0,
        onednn_linear: bool = True,
        lora_adapters: dict[str, str] | None = None,
        max_loras: int = 8,
        max_lora_rank: int = 64,
        lora_fold: bool = True,  # LoRA's stacked shrink folded into the base product (services/shard/lora/fold.py)
        quantize: str = "",
        grammar: bool = True,  # structured output (off with --disable-grammar-support: no matcher is ever built)
        decoder_walk: bool = True,  # the direct decoder walk where the architecture has one (model/decoder_walk.py)
        grammar_fill: str = "ahead",  # where structured output's masks are filled: "ahead" or "inline" (Settings)
        device_sampling: bool | None = None,  # one counter-keyed draw for all rows (sampling/counter.py); None: on CUDA
        cuda_graphs: tuple[int, ...] = (),  # decode buckets replayed as CUDA graphs (graphs.py)
        kv_prefault: bool = False,  # the KV cache made resident at start, on a thread (Settings.kv_prefault)
        attention: str = "auto",  # "torch", "triton", "cpu" or "auto" (attention_backend)
        cpu_kernels: bool = True,  # the C++ kernels on CPU in half precision where they build (cpu_kernels/)
        model: torch.nn.Module | None = None,  # built in memory (from_config); model_dir: its tokenizer, or None
        compile: bool = False,  # the walk's body compiled by inductor at start where it serves (model/compiled.py)
        compile_buckets: tuple[int, ...] = compiled_module.DEFAULT_BUCKETS,  # row counts compiled at start
    ) -> None:
        self.device = torch.device(device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.watermark_gamma = watermark_gamma
        self.watermark_delta = watermark_delta
        self.device_sampling = self.device.type == "cuda" if device_sampling is None else device_sampling
        # with a torch.distributed group (services.shard.tensor_parallel) transformers shards the model over it
        tp = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        kwargs = {} if tp == 1 else {"distributed_config": DistributedConfig(tp_plan="auto", tp_size=tp)}
        # quantized linears replace the dense ones before use_onednn, which then only packs what stayed dense
        load_kwargs = dict(dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION, **kwargs)
        if model is not None:
            self.model = model
        elif vision_loader.is_vision_config(model_store.read_config(model_dir)):  # images in (services/shard/vision)
            if quantize:
                raise ValueError("--quantize is not supported for vision-language models yet")
            self.model = vision_loader.from_pretrained(model_dir, attn=ATTN_IMPLEMENTATION, dtype=dtype, **kwargs)
        elif quantize:
            self.model = quantized_from_pretrained(model_dir, quantize, **load_kwargs)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, **load_kwargs)
        if tp == 1:
            self.model.to(self.device)
        self.model.eval()
        if onednn_linear and self.device.type == "cpu":
            use_onednn(self.model)
        # after use_onednn, which replaces the linears' forward: the LoRA hooks wrap whatever is installed
        self.lora = LoraRegistry(self.model, max_loras=max_loras, max_rank=max_lora_rank, fold=lora_fold)
        for name, folder in (lora_adapters or {}).items():
            self.lora.load(name, folder)
        self.lora.check_hooks()
        # a vision model: its encoder outputs merged at the placeholders of the language model, which runs as a text
        # model (None: a text model)
        self.vision: ImageState | None = None
        self.text_model = self.model
        if vision_loader.is_vision_model(self.model):
            self.vision = ImageState(self.model, model_dir)
            self.text_model = vision_loader.text_model(self.model, ATTN_IMPLEMENTATION)
        # the C++ kernels for the CPU (half precision; float32 is the exact mode): loaded, else the torch ops serve
        self.cpu_kernels = cpu_kernels and kernels_module.wanted(self.device, dtype) and kernels_module.load()
        # the direct decoder walk, or None (transformers' forward) and why
        self.walk, self.walk_reason = walk_module.build(self.text_model, tp, decoder_walk, self.cpu_kernels)
        # the walk's body compiled (bf16 on oneDNN), or None and why (float32 stays eager: model/compiled.py)
        self.compiled, self.compiled_reason = compiled_module.build(
            self.walk, dtype, compile and self.device.type == "cpu"
        )
        cfg = self.model.config.get_text_config()
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        if self.num_kv_heads % tp or cfg.num_attention_heads % tp:
            raise ValueError(
                f"--num-shard {tp} must divide the model's {cfg.num_attention_heads} attention heads "
                f"and {self.num_kv_heads} KV heads"
            )
        self.num_kv_heads //= tp  # this rank's share: the attention function sees only its heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # with CUDA graphs, one block past the scheduler's: the padded rows' scratch block
        shape = (
            self.num_kv_heads,
            num_blocks + graphs_module.scratch_blocks(cuda_graphs, self.device),
            block_size,
            self.head_dim,
        )
        self.kv_cache, self.kv_flat = allocate_pages(self.num_layers, shape, dtype, self.device, kv_prefault)
        self.attention = attention_backend(attention, self.device, self.cpu_kernels)
        # pure-decode steps replayed as CUDA graphs, or None and why (services/shard/graphs.py)
        self.graphs, self.graphs_reason = graphs_module.build(
            cuda_graphs,
            self.forward_packed,
            self.kv_cache,
            self.kv_flat,
            num_blocks,
            block_size,
            self.device,
            self.attention,
        )
        self.seqs: dict[int, SequenceState] = {}
        self.timings: dict[str, float] | None = None  # a profiler's dict: seconds per part of every step, summed
        self._pick_pool = PickGenerators(self.device)
        eos_ids = model_store.model_info(model_dir)["eos_token_ids"] if model is None else config_eos_ids(cfg)
        # grammar needs the tokenizer's folder: an in-memory model without one serves no structured output
        self.grammars = ShardGrammars(model_dir or "", eos_ids, grammar and bool(model_dir), fill=grammar_fill)
        if self.compiled is not None:  # at start, before the shard answers the scheduler's probe
            self.compiled.warm(self._warm_steps(compile_buckets))

    @torch.inference_mode()  # inference tensors, as a step's: the compiled graphs guard on it
    def _warm_steps(self, rows: tuple[int, ...]) -> dict[int, tuple]:
        """Decode steps of each row count for the compile at start: token 0 at position 0, every row's K/V in the
        first slot (nothing lives in the cache yet; a sequence writes its slots before it reads them)."""
        dev, steps = self.device, {}
        for n in rows:
            zeros = np.zeros(n, np.int64)
            paged = PagedBatch.from_host(
                self.kv_cache, zeros, np.arange(n + 1), zeros, np.zeros((n, 1), np.int64), self.block_size, dev,
                kv_flat=self.kv_flat, backend=self.attention,
            )  # fmt: skip
            ids = torch.zeros(n, dtype=torch.long, device=dev)
            steps[n] = (ids, ids.clone(), paged)
        return steps

    @classmethod
    def from_config(
        cls,
        config,
        *,
        num_blocks: int,
        tokenizer_dir: str | None = None,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        **kwargs,
    ) -> ModelRunner:
        """A runner over a model built in memory from a transformers `config`, with the random weights its
        architecture initializes from `seed`: an 8B-shaped model for a benchmark or the device check, no download.

        The weights are made on `device` itself (its torch.device context), so a GPU's gigabytes of them never
        pass through host memory. `tokenizer_dir`: a folder whose tokenizer.json serves structured output (none:
        grammar off). One device only (no tensor parallelism); `kwargs` are __init__'s. The server never builds
        one: it loads a folder (__init__).
        """
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            raise ValueError("a model built in memory runs on one device (no tensor parallelism)")
        torch.manual_seed(seed)  # seeds every device: the same seed on the same device gives the same weights
        with torch.device(device):
            if vision_loader.is_vision_config(config.to_dict()):
                model = vision_loader.from_config(config, attn=ATTN_IMPLEMENTATION, dtype=dtype)
            else:
                model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
        return cls(tokenizer_dir, num_blocks=num_blocks, dtype=dtype, device=device, model=model, **kwargs)

    # ---------------------------------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        """Apply the plan's diff, run its rows in one forward, return one sampled token per `sample` row."""
        t0 = time.perf_counter()
        fed = {int(s) for s in plan.seqs}
        # A finished seq not fed this step goes first (its handle may be reused by `new` in the same plan);
        # one that is still fed is dropped after the forward.
        for seq in plan.finished:
            if seq not in fed:
                self._drop(seq)
        for new in plan.new:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(int(new.sampling.seed))
            history = None
            if new.sampling.keeps_history():
                history = History()
                # a prefix-cache hit (or a recompute after preemption) starts past tokens this shard never fed:
                # the scheduler sends them so penalties and the watermark see the whole sequence
                history.extend(np.asarray(new.prefix_ids, dtype=np.int64))
            if new.adapter and new.adapter not in self.lora.adapters:
                raise ValueError(f"plan asks for LoRA adapter {new.adapter!r}, which this shard has not loaded")
            self.seqs[new.seq] = SequenceState(new.sampling, gen, history=history, adapter=new.adapter)
        refused = self._open_images(plan)
        for new in plan.new:
            if new.grammar:  # its matcher, with the tokens it generated already replayed (a recompute)
                self.grammars.open(new.seq, new.grammar, new.grammar_ids)
        for seq, keep in plan.trim.items():  # blocks the scheduler freed (past rejected drafts)
            if seq in self.seqs:
                del self.seqs[seq].blocks[keep:]
        for seq, blocks in plan.blocks.items():
            self._seq(seq).blocks.extend(int(b) for b in blocks)

        result = StepResult(step=plan.step, **_empty_rows())
        encoded = self.vision.encoder.seconds if self.vision is not None else 0.0
        if fed:
            self._step(plan, result)
        # rows that fail alone, each with what failed: its grammar (no token fits) or its images (refused at open)
        result.errors = {**{seq: f"grammar: {why}" for seq, why in result.errors.items()}, **refused}
        if self.vision is not None:
            result.encode_s = self.vision.encoder.seconds - encoded
        for seq in plan.finished:
            if seq in fed:
                self._drop(seq)
        result.forward_s = time.perf_counter() - t0
        return result

    def _drop(self, seq: int) -> None:
        self.seqs.pop(seq, None)
        self.grammars.discard(seq)
        if self.vision is not None:
            self.vision.drop(seq)

    def _open_images(self, plan: StepPlan) -> dict[int, str]:
        """The new sequences' images (services/shard/vision/image_state.py); the sequences refused, with why."""
        if self.vision is not None:
            return self.vision.open(plan)
        if any(new.images for new in plan.new):
            raise ValueError("plan sends images to a model without a vision tower")
        return {}

    def reset(self) -> None:
        """Drop every sequence (a new scheduler's probe)."""
        self.seqs.clear()
        self.grammars.clear()
        if self.vision is not None:
            self.vision.clear()

    def _seq(self, seq: int) -> SequenceState:
        try:
            return self.seqs[seq]
        except KeyError:
            raise ValueError(f"plan refers to unknown sequence {seq}") from None

    @torch.inference_mode()
    def _step(self, plan: StepPlan, result: StepResult) -> None:
        """prepare → forward → sample → pack, as nano-vllm's ModelRunner.run."""
        t = time.perf_counter()
        batch = self._prepare(plan)
        t = self._lap("prepare", t)
        try:
            logits = self._forward(batch)
        finally:
            self.lora.clear_step()
        t = self._lap("forward", t)
        choice = self._sample(batch, logits, result)
        t = self._lap("sampling", t)
        self._pack(batch, choice, result)
        self._lap("pack", t)

    def _lap(self, part: str, since: float) -> float:
        """Add the part's seconds to `timings` when a profiler set it; returns now."""
        now = time.perf_counter()
        if self.timings is not None:
            self.timings[part] = self.timings.get(part, 0.0) + now - since
        return now

    def _prepare(self, plan: StepPlan) -> Batch:
        """Check the plan's rows against what we hold; lay them out as one packed batch: positions, slots, tables."""
        seqs = np.asarray(plan.seqs, dtype=np.int64)
        num_tokens = np.asarray(plan.num_tokens, dtype=np.int64)
        context_lens = np.asarray(plan.context_lens, dtype=np.int64)
        sample_rows = np.asarray(plan.sample, dtype=bool)
        fed_ids = np.asarray(plan.token_ids, dtype=np.int64)
        drafts = None
        if plan.drafts is not None and len(plan.drafts) and plan.drafts.any():
            drafts = np.asarray(plan.drafts, dtype=np.int64)
            if (drafts >= num_tokens).any() or (drafts[~sample_rows] > 0).any():
                raise ValueError("plan drafts must be fewer than a sampled row's fed tokens")
        cu = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(num_tokens, out=cu[1:])
        if int(cu[-1]) != len(fed_ids) or (num_tokens < 1).any():
            raise ValueError("plan rows do not match its token ids")
        states = [self._seq(seq) for seq in seqs.tolist()]
        # position of every fed token: its row's context length + its index within the row
        positions = np.arange(cu[-1]) - np.repeat(cu[:-1], num_tokens) + np.repeat(context_lens, num_tokens)

        bs = self.block_size
        n_blocks = np.fromiter((len(st.blocks) for st in states), np.int64, len(states))
        short = np.flatnonzero(n_blocks * bs < context_lens + num_tokens)
        if len(short):
            i = int(short[0])
            length = int(context_lens[i] + num_tokens[i])
            raise ValueError(f"sequence {seqs[i]} needs {length} slots but has {n_blocks[i]} blocks of {bs}")
        tables = np.full((len(states), int(n_blocks.max())), -1, dtype=np.int64)
        for i, st in enumerate(states):
            tables[i, : n_blocks[i]] = st.blocks
        # slot of position p in row r: tables[r, p // bs] * bs + p % bs
        rows = np.repeat(np.arange(len(seqs)), num_tokens)
        slot_mapping = tables[rows, positions // bs] * bs + positions % bs

        dev = self.device
        paged = PagedBatch.from_host(
            self.kv_cache, slot_mapping, cu, context_lens, tables, bs, dev, kv_flat=self.kv_flat, backend=self.attention
        )
        # rows still in their prompt that report prompt logprobs need the LM head on every fed position
        prompt_rows = [i for i, st in enumerate(states) if st.prefilling and st.sampling.prompt_logprobs]
        keep, sample_at, prompt_at = kept_positions(cu, sample_rows, prompt_rows, drafts)
        draw_positions = (context_lens + num_tokens)[sample_rows]
        if drafts is not None:  # each pick draws the token after its position
            picks = 1 + drafts[sample_rows]
            draw_positions = np.repeat(draw_positions - picks, picks) + _ranks(picks) + 1
        if any(st.adapter for st in states):  # rows grouped by adapter once per step; base-only steps skip this
            self.lora.set_step([st.adapter for st in states], num_tokens)
        # a vision model's step: its placeholders' embeddings and its rotary positions (M-RoPE's, shifted past images)
        images, rope_positions = None, positions
        if self.vision is not None:
            images, rope_positions = self.vision.step(seqs, context_lens, num_tokens, cu, positions, paged)
        return Batch(
            images=images,
            seqs=seqs,
            states=states,
            cu=cu,
            draw_positions=draw_positions,
            sample_rows=sample_rows,
            drafts=drafts,
            fed_ids=fed_ids,
            input_ids=torch.from_numpy(fed_ids).to(dev),
            position_ids=torch.from_numpy(rope_positions).to(dev),
            paged=paged,
            keep=torch.from_numpy(np.ascontiguousarray(keep)).to(dev),
            prompt_rows=prompt_rows,
            prompt_at=prompt_at,
            sample_at=sample_at,
        )

    def _forward(self, batch: Batch) -> torch.Tensor:
        """One forward over every row; the logits of the kept positions only, [kept, vocab]."""
        if batch.images is not None:  # image placeholders fed: their embeddings merged (services/shard/vision)
            embeds = merge(self.text_model.get_input_embeddings()(batch.input_ids), batch.images)
            return self.forward_packed(batch.input_ids, batch.position_ids, batch.keep, batch.paged, embeds)
        # a pure-decode step in a bucket: its graph's replay (None: run it eagerly); a graph places each token at
        # its index, so not while an M-RoPE model holds sequences with images (their positions are shifted)
        if self.graphs is not None and not (self.vision is not None and self.vision.shifts_positions):
            logits = self.graphs.step(batch)
            if logits is not None:
                return logits
        if self.compiled is not None:
            if not any(st.adapter for st in batch.states):
                return self.compiled.forward(batch.input_ids, batch.position_ids, batch.keep, batch.paged)
            self.compiled.counts["eager: LoRA rows"] += 1  # the compiled body calls the base products only
        return self.forward_packed(batch.input_ids, batch.position_ids, batch.keep, batch.paged)

    def forward_packed(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        keep: torch.Tensor,
        paged: PagedBatch,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The eager forward of a packed step ([T] ids and positions, or M-RoPE's [3, T] positions): the decoder
        walk's or transformers'."""
        if self.walk is not None:
            return self.walk.forward(input_ids, position_ids, keep, paged, inputs_embeds)
        return self.text_model(
            input_ids=None if inputs_embeds is not None else input_ids[None],
            inputs_embeds=None if inputs_embeds is None else inputs_embeds[None],
            position_ids=position_ids[None] if position_ids.dim() == 1 else position_ids[:, None],  # M-RoPE: [3, 1, T]
            use_cache=False,
            logits_to_keep=keep,
            paged=paged,
        ).logits[0]

    def _sample(self, batch: Batch, logits: torch.Tensor, result: StepResult) -> Choice:
        """Prompt logprobs of the prompt rows (into `result`), then one token per sampled row."""
        cu, states = batch.cu, batch.states
        for i, st in enumerate(states):  # the fed tokens join the history before the choice that reads it
            if st.history is not None:
                st.history.extend(batch.fed_ids[cu[i] : cu[i + 1]])
        if batch.prompt_rows:
            self._prompt_logprobs(batch, logits, result)
            logits = logits[torch.from_numpy(batch.sample_at).to(self.device)]
        sampled = batch.sampled_states()
        generators = [st.generator for st in sampled]
        histories = [None if st.history is None else st.history.view() for st in sampled]
        # rows with a grammar are masked after the processors, before the warpers (TGI's order)
        batch.keys = self.grammars.keys(batch.seqs[batch.sample_rows].tolist())
        if batch.drafts is not None:  # a pick per position of each drafted row
            picked = expand_picks(sampled, batch.drafted, batch.keys, self._pick_pool)
            sampled, generators, histories, batch.keys, batch.chains = picked
        # Each draw is seeded by the request's seed and the position of the token it draws: a sequence preempted
        # and recomputed, or replayed on a restarted shard, or verifying drafts, draws the same tokens again.
        keys = None
        if self.device_sampling and any(st.sampling.samples() for st in sampled):
            keys = DrawKeys.of([st.sampling.seed for st in sampled], batch.draw_positions, self.device)
        elif not self.device_sampling:
            for st, gen, position in zip(sampled, generators, batch.draw_positions.tolist()):
                if st.sampling.samples():
                    gen.manual_seed(draw_seed(st.sampling.seed, position))
        errors = result.errors = {}
        return choose(
            logits,
            [st.sampling for st in sampled],
            generators,
            histories,
            watermark_gamma=self.watermark_gamma,
            watermark_delta=self.watermark_delta,
            constrain=None if batch.keys is None else self.grammars.mask(batch.keys, errors, batch.chains),
            keys=keys,
            kernels=self.cpu_kernels,
            # min_tokens: each pick's length is its draw position (a drafted row's picks each their own)
            lengths=batch.draw_positions.tolist() if any(st.sampling.min_length for st in sampled) else None,
        )

    def _pack(self, batch: Batch, choice: Choice, result: StepResult) -> None:
        """The sampled tokens into the result's frames (drafted rows: the accepted ones); a sampled row ends its
        sequence's prompt."""
        result.seqs = batch.seqs[batch.sample_rows].astype(np.int32)
        if batch.drafts is not None:  # keep each drafted row's accepted picks
            drafts = batch.drafts[batch.sample_rows]
            keep, result.token_counts = accept(choice.token_ids.cpu().numpy(), batch.drafted)
            choice = select(choice, keep)
            if batch.keys is not None:
                batch.keys = [k for k, kept in zip(batch.keys, keep.tolist()) if kept]
            for st, d, n in zip(batch.sampled_states(), drafts.tolist(), result.token_counts.tolist()):
                if st.history is not None and d > n - 1:  # rejected drafts leave the history (penalties)
                    st.history.drop(d - (n - 1))
        result.token_ids = choice.token_ids.cpu().numpy().astype(np.int32)
        if batch.keys is not None:  # the matchers move on; the next step's masks fill while the scheduler plans
            self.grammars.advance(batch.keys, result.token_ids.tolist(), result.errors)
        for st in batch.sampled_states():
            st.prefilling, st.carried = False, None
        result.logprobs = choice.logprobs.cpu().numpy().astype(np.float32)
        if choice.top_counts is not None:
            result.top_counts = choice.top_counts.cpu().numpy().astype(np.int32)
            result.top_ids = choice.top_ids.cpu().numpy().astype(np.int32)
            result.top_logprobs = choice.top_logprobs.cpu().numpy().astype(np.float32)

    def _prompt_logprobs(self, batch: Batch, logits: torch.Tensor, result: StepResult) -> None:
        """Fill the result's prompt logprobs: one run per prompt row, in row order."""
        cu, runs, greedy = batch.cu, [], []
        for i, at in zip(batch.prompt_rows, batch.prompt_at):
            st, n = batch.states[i], int(cu[i + 1] - cu[i])
            greedy.append(chunk_greedy(logits[at : at + n], st.carried))  # (OpenAI's prompt top_logprobs)
            lps, last = chunk_logprobs(logits[at : at + n], batch.input_ids[cu[i] : cu[i + 1]], st.carried)
            st.carried = last  # dropped when the row samples (the prompt is over)
            runs.append(lps)
        result.prompt_seqs = batch.seqs[batch.prompt_rows].astype(np.int32)
        result.prompt_counts = (cu[1:] - cu[:-1])[batch.prompt_rows].astype(np.int32)
        result.prompt_logprobs = torch.cat(runs).cpu().numpy().astype(np.float32)
        result.prompt_greedy_ids = torch.cat([g[0] for g in greedy]).cpu().numpy().astype(np.int32)
        result.prompt_greedy_logprobs = torch.cat([g[1] for g in greedy]).cpu().numpy().astype(np.float32)


def config_eos_ids(config) -> list[int]:
    """The EOS ids a transformers config names (one id, a list of them, or none)."""
    eos = getattr(config, "eos_token_id", None)
    return [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]


def draw_seed(seed: int, position: int) -> int:
    """The generator seed for the token at `position` of a request seeded `seed` (64 bits, positions spread by a
    golden-ratio multiplier so that neighbouring positions start far apart)."""
    return (seed + (position + 1) * 0x9E3779B97F4A7C15) & 0xFFFF_FFFF_FFFF_FFFF


def _ranks(counts: np.ndarray) -> np.ndarray:
    """0, 1, … within each run of `counts` consecutive items."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def _empty_rows() -> dict[str, np.ndarray]:
    """Every row frame of a StepResult, empty (a step with no rows, or no alternatives / prompt logprobs)."""
    i4, f4 = np.zeros(0, np.int32), np.zeros(0, np.float32)
    return dict(
        seqs=i4,
        token_counts=i4,
        token_ids=i4,
        logprobs=f4,
        top_counts=i4,
        top_ids=i4,
        top_logprobs=f4,
        prompt_seqs=i4,
        prompt_counts=i4,
        prompt_logprobs=f4,
        prompt_greedy_ids=i4,
        prompt_greedy_logprobs=f4,
    )
