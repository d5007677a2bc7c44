"""CUDA graphs for pure-decode steps: a step's metadata padded to its bucket (the sizes of TGI's `--cuda-graphs`,
which the launcher parses), the fixed-shape input buffers graphs read, and (CUDA only) their capture and replay.

A pure-decode step (every row feeds one token: no prompt chunk, no drafts) of n rows runs as the graph of the
smallest bucket ≥ n; larger steps, and every other step, run eagerly. The padded rows n … bucket-1 feed token 0 at
position 0 with no context, and their only KV block is the scratch block, a block past the scheduler's
(`num_blocks`: the cache is allocated one block larger): they write their K/V to the scratch block's first slot,
read nothing else, and are never sampled (only logits[:n] are read). The buffers are allocated once, at the
largest bucket, and updated in place before each replay, since a graph reads the addresses it was captured with.
The bucket choice and the padding are pure and run on any device; `DecodeGraphs` and the runner's `RunnerGraphs`
need CUDA and the Triton attention (no host-side step), check their first replay against the eager forward, and
are exercised only on a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from services.shard.attention.paged import PagedBatch
from services.shard.step_batch import Batch

log = logging.getLogger("switchyard.shard")


def bucket_for(rows: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds `rows` rows; None when none does (the step runs eagerly)."""
    for b in buckets:
        if b >= rows:
            return b
    return None


def pure_decode(num_tokens: np.ndarray, drafts: np.ndarray | None = None) -> bool:
    """Whether a step is pure decode: every row feeds exactly one token and drafts none."""
    return len(num_tokens) > 0 and bool((num_tokens == 1).all()) and (drafts is None or not drafts.any())


@dataclass
class DecodeStep:
    """One decode step's metadata, one entry per row (numpy, host side)."""

    input_ids: np.ndarray  # [rows] int64
    positions: np.ndarray  # [rows] int64
    slot_mapping: np.ndarray  # [rows] int64: where each row's new K/V go
    block_tables: np.ndarray  # [rows, blocks] int64, padded with -1
    context_lens: np.ndarray  # [rows] int64: tokens in the cache before this step

    @property
    def rows(self) -> int:
        return len(self.input_ids)


def pad_step(step: DecodeStep, bucket: int, max_blocks: int, scratch_block: int, block_size: int) -> DecodeStep:
    """The step padded to `bucket` rows and `max_blocks` table columns (fixed shapes): real rows first, as given;
    padded rows feed token 0 at position 0, write the scratch block's first slot and see only the scratch block."""
    n = step.rows
    if n > bucket:
        raise ValueError(f"{n} rows do not fit a bucket of {bucket}")
    if step.block_tables.shape[1] > max_blocks:
        raise ValueError(f"block tables of {step.block_tables.shape[1]} blocks exceed the buffers' {max_blocks}")
    pad = bucket - n
    tables = np.full((bucket, max_blocks), -1, dtype=np.int64)
    tables[:n, : step.block_tables.shape[1]] = step.block_tables
    tables[n:, 0] = scratch_block
    return DecodeStep(
        input_ids=np.concatenate([step.input_ids, np.zeros(pad, np.int64)]),
        positions=np.concatenate([step.positions, np.zeros(pad, np.int64)]),
        slot_mapping=np.concatenate([step.slot_mapping, np.full(pad, scratch_block * block_size, np.int64)]),
        block_tables=tables,
        context_lens=np.concatenate([step.context_lens, np.zeros(pad, np.int64)]),
    )


def decode_step(batch: Batch) -> DecodeStep | None:
    """A runner batch's metadata as a DecodeStep when it is pure decode with every row sampled, no prompt
    logprobs and no LoRA adapter (what a graph computes); None otherwise."""
    num_tokens = batch.cu[1:] - batch.cu[:-1]
    if batch.prompt_rows or not batch.sample_rows.all() or not pure_decode(num_tokens, batch.drafts):
        return None
    if any(st.adapter for st in batch.states):  # LoRA groups rows per step on the host: not in a graph
        return None
    paged = batch.paged
    context, tables, bs = paged.host_context, paged.host_tables, paged.block_size
    slots = tables[np.arange(len(context)), context // bs] * bs + context % bs
    return DecodeStep(batch.fed_ids, context.copy(), slots, tables, context)


class DecodeBuffers:
    """The fixed-shape device tensors a captured decode graph reads, sized for the largest bucket; a bucket's
    graph reads the first `bucket` rows of each. They start as padded rows (a warm-up or capture run before the
    first load writes the scratch block only); `load` writes a padded step into them in place."""

    def __init__(
        self, max_bucket: int, max_blocks: int, device: torch.device, scratch_block: int, block_size: int
    ) -> None:
        self.input_ids = torch.zeros(max_bucket, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_bucket, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(max_bucket, dtype=torch.long, device=device)
        self.block_tables = torch.full((max_bucket, max_blocks), -1, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(max_bucket, dtype=torch.int32, device=device)
        # pure decode: row i's one query is token i, and every row's logits are kept
        self.cu_seqlens_q = torch.arange(max_bucket + 1, dtype=torch.int32, device=device)
        self.keep = torch.arange(max_bucket, dtype=torch.long, device=device)
        empty = DecodeStep(
            *(np.zeros(0, np.int64) for _ in range(3)), np.zeros((0, 0), np.int64), np.zeros(0, np.int64)
        )
        self.load(pad_step(empty, max_bucket, max_blocks, scratch_block, block_size))

    def view(self, bucket: int) -> dict[str, torch.Tensor]:
        """The first `bucket` rows of every buffer (views: same storage, what a graph is captured with)."""
        return dict(
            input_ids=self.input_ids[:bucket],
            positions=self.positions[:bucket],
            slot_mapping=self.slot_mapping[:bucket],
            block_tables=self.block_tables[:bucket],
            context_lens=self.context_lens[:bucket],
            cu_seqlens_q=self.cu_seqlens_q[: bucket + 1],
            keep=self.keep[:bucket],
        )

    def load(self, padded: DecodeStep) -> None:
        """Copy a padded step into the buffers' first rows (in place: the captured addresses stay valid)."""
        b = padded.rows
        for name, dtype in (("input_ids", torch.long), ("positions", torch.long), ("slot_mapping", torch.long)):
            getattr(self, name)[:b].copy_(torch.from_numpy(getattr(padded, name)).to(dtype), non_blocking=True)
        self.block_tables[:b].copy_(torch.from_numpy(padded.block_tables.astype(np.int32)), non_blocking=True)
        self.context_lens[:b].copy_(torch.from_numpy(padded.context_lens.astype(np.int32)), non_blocking=True)


# One decode forward over a bucket's buffer views → its logits [bucket, vocab]; what a graph captures.
DecodeForward = Callable[[dict[str, torch.Tensor]], torch.Tensor]


class DecodeGraphs:
    """Captured decode graphs, one per bucket, sharing one memory pool and one set of buffers (CUDA only).

    `capture(forward)` runs `forward` once per bucket on a side stream (warm-up: Triton compiles, allocator
    settles), then captures it, largest bucket first, in a shared pool; `run(step)` pads the step, loads the
    buffers, replays the bucket's graph and returns the real rows' logits (a view into the graph's output,
    valid until the next replay). Only exercised on a GPU (scripts/gpu_check.py's job), never on CPU.
    """

    def __init__(
        self, buckets: tuple[int, ...], max_blocks: int, scratch_block: int, block_size: int, device: torch.device
    ) -> None:
        if not torch.cuda.is_available() or torch.device(device).type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        if not buckets:
            raise ValueError("no buckets: --cuda-graphs 0 disables graphs")
        self.buckets, self.max_blocks = buckets, max_blocks
        self.scratch_block, self.block_size = scratch_block, block_size
        self.buffers = DecodeBuffers(max(buckets), max_blocks, torch.device(device), scratch_block, block_size)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def capture(self, forward: DecodeForward) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside capture: lazy inits, kernel compiles
            for b in self.buckets:
                forward(self.buffers.view(b))
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for b in sorted(self.buckets, reverse=True):  # largest first: the smaller ones reuse its pool
            graph = torch.cuda.CUDAGraph()
            # thread-local: the grammar's mask worker may touch the device meanwhile, outside the captured stream
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self.outputs[b] = forward(self.buffers.view(b))
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()

    def run(self, step: DecodeStep) -> torch.Tensor | None:
        """The step's logits [rows, vocab] by replay; None when no bucket holds it (run it eagerly)."""
        bucket = bucket_for(step.rows, self.buckets)
        if bucket is None or bucket not in self.graphs or step.block_tables.shape[1] > self.max_blocks:
            return None
        self.buffers.load(pad_step(step, bucket, self.max_blocks, self.scratch_block, self.block_size))
        self.graphs[bucket].replay()
        return self.outputs[bucket][: step.rows]


# (input_ids, position_ids, keep, paged) → logits [kept, vocab]: the runner's eager packed forward
PackedForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, PagedBatch], torch.Tensor]


def scratch_blocks(cuda_graphs: tuple[int, ...], device: torch.device) -> int:
    """KV blocks the runner allocates past the scheduler's for the graphs' padded rows: 1 with graphs asked for
    on CUDA, else 0."""
    return int(bool(cuda_graphs) and torch.device(device).type == "cuda")


class RunnerGraphs:
    """The runner's side of decode graphs: `step(batch)` replays a pure-decode step's bucket (capturing every
    bucket on the first such step) and returns its logits, or None for the runner to run the step eagerly.

    The first replay is checked against the eager forward of the same step (the same K/V are written again, the
    same values); a capture that fails or disagrees turns graphs off for good, with a warning, and the server runs
    on eagerly. Needs CUDA and the Triton attention backend (`build` says why not otherwise).
    """

    def __init__(
        self,
        buckets: tuple[int, ...],
        forward: PackedForward,
        kv_cache: list,
        kv_flat: list | None,
        num_blocks: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.forward, self.kv_cache, self.kv_flat, self.block_size = forward, kv_cache, kv_flat, block_size
        # a row never holds more blocks than the scheduler has; the scratch block is the one past them
        self.graphs = DecodeGraphs(buckets, num_blocks, num_blocks, block_size, device)
        self.state = "pending"  # "pending" capture, "on", or "off" (a failed capture or check)

    def _captured_forward(self, views: dict[str, torch.Tensor]) -> torch.Tensor:
        bucket = views["input_ids"].shape[0]
        paged = PagedBatch(
            kv_cache=self.kv_cache,
            kv_flat=self.kv_flat,
            slot_mapping=views["slot_mapping"],
            cu_seqlens_q=views["cu_seqlens_q"],
            context_lens=views["context_lens"],
            block_tables=views["block_tables"],
            block_size=self.block_size,
            host_cu=np.arange(bucket + 1),  # one query per row: what the Triton launch sizes its tiles by
            backend="triton",
        )
        return self.forward(views["input_ids"], views["positions"], views["keep"], paged)

    def step(self, batch: Batch) -> torch.Tensor | None:
        if self.state == "off":
            return None
        step = decode_step(batch)
        if step is None or bucket_for(step.rows, self.graphs.buckets) is None:
            return None
        if self.state == "on":
            return self.graphs.run(step)
        try:
            self.graphs.capture(self._captured_forward)
            logits = self.graphs.run(step)
            eager = self.forward(batch.input_ids, batch.position_ids, batch.keep, batch.paged)
            same = logits is not None and torch.allclose(logits.float(), eager.float(), rtol=1e-3, atol=1e-3)
        except Exception as e:  # noqa: BLE001 — any capture failure: run eagerly
            log.warning("CUDA graphs off: capture failed (%s: %s)", type(e).__name__, e)
            self.state, self.graphs.graphs = "off", {}
            return None
        if not same:
            log.warning("CUDA graphs off: the first replay disagrees with the eager forward")
            self.state, self.graphs.graphs = "off", {}
            return eager
        self.state = "on"
        return logits


def build(
    cuda_graphs: tuple[int, ...],
    forward: PackedForward,
    kv_cache: list,
    kv_flat: list | None,
    num_blocks: int,
    block_size: int,
    device: torch.device,
    attention: str,
) -> tuple[RunnerGraphs | None, str]:
    """The runner's decode graphs, or None and why."""
    buckets = tuple(sorted(set(cuda_graphs)))
    if not buckets:
        return None, "no --cuda-graphs buckets"
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None, "CUDA graphs need CUDA"
    if attention != "triton":
        return None, f"CUDA graphs need the triton attention backend, not {attention!r}"
    return RunnerGraphs(buckets, forward, kv_cache, kv_flat, num_blocks, block_size, device), ""
