"""Continuous batching: which sequences run in the next step, and what their tokens mean.

Pure bookkeeping, no sockets (the loop in `__main__` does IO), so it is tested on its own. The policy is TGI v3's
chunking path plus what TGI lacks: FIFO admission once a request's next chunk fits in the free KV blocks; chunked
prefill in the same forward as the running decodes, capped while any sequence decodes (prefill_pacing.py) and
closed to further prompts at `prefill_saturation_tokens`; prefix caching of full blocks by chain hashes;
preemption by recompute of the newest running sequence (under --scheduling-policy priority the lowest-ranked, and a
waiting request that outranks a full batch preempts it: priority.py), with nothing streamed twice.
docs/scheduling.md tells why.
"""

from __future__ import annotations

import itertools
import math
from collections import deque

import msgspec
import numpy as np

from libs.protocol.messages import FINISH_ABORTED, FINISH_EOS, FINISH_LENGTH, FINISH_NONE, TokenizedRequest
from libs.protocol.params import SamplingParams
from libs.protocol.step_messages import NewSequence, StepPlan, StepResult
from libs.runtime.settings import BLOCK_SIZE
from services.scheduler.block_allocator import BlockAllocator, blocks_for
from services.scheduler.drafting import Drafter
from services.scheduler.images import images_in_prefix, images_to_feed, plan_pixels, whole_image_chunk
from services.scheduler.prefill_pacing import PrefillPacing
from services.scheduler.prefix_index import PrefixIndex
from services.scheduler.priority import PriorityOrder
from services.scheduler.sequence import Emitted, Sequence
from services.scheduler.siblings import Siblings


class Batcher:
    def __init__(
        self,
        num_blocks: int,
        *,
        max_batch_size: int,
        max_batch_prefill_tokens: int,
        eos_ids: set[int],
        max_waiting_tokens: int = 0,
        waiting_served_ratio: float = 0.0,
        prefix_caching: bool = True,
        block_size: int = BLOCK_SIZE,
        max_prefill_tokens_while_decoding: int = 0,
        max_prefill_ms_while_decoding: float = 0.0,
        prefill_saturation_tokens: int = 0,
        speculate: int = 0,
        speculate_policy: str = "adaptive",
        scheduling_policy: str = "fcfs",
        priority_aging_s: float = 0.0,
        whole_images: bool = False,
    ):
        self.allocator = BlockAllocator(num_blocks)
        self.max_batch_size = max_batch_size
        self.max_batch_prefill_tokens = max_batch_prefill_tokens
        self.pacing = PrefillPacing(max_prefill_tokens_while_decoding, max_prefill_ms_while_decoding)
        self.prefill_saturation_tokens = prefill_saturation_tokens
        self.eos_ids = eos_ids
        self.max_waiting_tokens = max_waiting_tokens
        self.waiting_served_ratio = waiting_served_ratio
        self.block_size = block_size
        self.whole_images = whole_images  # a prefill chunk never ends inside an image's block (images.py)
        # blocks kept free at admission, so the running decodes can grow a while before anything is preempted
        self.watermark = max(1, num_blocks // 100)
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        self.by_request: dict[str, Sequence] = {}
        self._to_drop: list[int] = []  # finished or preempted seqs the shard has not been told about
        self._handles = itertools.count(1)
        # per planned step not applied yet: its rows as (seq, handle, computed after, drafts), to index the blocks
        # they fill (a drafted row's accepted drafts add to its computed tokens when the result comes)
        self._inflight: dict[int, list[tuple[Sequence, int, int, int]]] = {}
        always = speculate_policy == "always"  # --speculate-policy: the adaptive rule off
        self.drafter = Drafter(speculate, always) if speculate > 0 else None  # speculative decoding (--speculate)
        self._pixels: list[np.ndarray] = []  # the next plan's images' pixels, gathered as sequences are admitted
        self._trim: dict[int, int] = {}  # seq → blocks it keeps, for the next plan (rejected drafts' blocks freed)
        self.step_accepted: list[int] = []  # speculating: per sampled row of the last applied step, drafts accepted
        self._since_join = 0  # steps since waiting requests last joined a running batch
        # --scheduling-policy priority: waiting and running ordered by rank, the worst gives way (priority.py)
        self.priority = PriorityOrder(priority_aging_s) if scheduling_policy == "priority" else None
        self.step_constrained = 0  # constrained rows of the last planned step
        self.counters = {
            "steps": 0,
            "prefill_rows": 0,
            "decode_rows": 0,
            "joined_steps": 0,
            "generated": 0,
            "prefix_queried_tokens": 0,  # prompt tokens looked up in the prefix cache
            "prefix_hit_tokens": 0,  # of them, found (not recomputed)
            "lora_prefix_hit_tokens": 0,  # of them, found for sequences that run with a LoRA adapter
            "lora_generated": 0,  # tokens generated with a LoRA adapter
            "preemptions": 0,
            "chunked_prefills": 0,  # prefill rows that fed only part of what remained
            "saturated_steps": 0,  # steps that left waiting prompts for later: their prefill was saturated
            "constrained_rows": 0,  # sampled rows whose request has a grammar (the shard masks them)
            "draft_tokens": 0,  # speculative decoding: tokens drafted (and verified)
            "accepted_tokens": 0,  # of them, accepted
            "priority_preemptions": 0,  # running sequences preempted for a waiting one that outranks them
        }
        self.prefix = PrefixIndex(self.allocator, block_size, prefix_caching, self.counters)
        self.siblings = Siblings(block_size, self.counters)  # the `n` choices of a request: one prompt prefill

    def add(self, req: TokenizedRequest) -> None:
        if req.request_id in self.by_request:
            return  # a duplicate delivery: the request is already here
        s = Sequence(0, req)
        if self.priority is not None:
            self.priority.stamp(s)
        self.by_request[req.request_id] = s
        self.waiting.append(s)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ---- LoRA adapters (services/scheduler/lora.py) ---------------------------------------------
    def adapter_in_use(self, name: str) -> bool:
        """A request of this adapter runs or waits."""
        return any(s.req.adapter == name for s in self.by_request.values())

    def key_adapter(self, name: str, key: str | None) -> None:
        """The prefix-cache key of an adapter's blocks from now on (None: its name). A reloaded adapter gets a new
        one, so blocks cached by an earlier adapter of the same name never serve it."""
        if key is None:
            self.prefix.hash_keys.pop(name, None)
        else:
            self.prefix.hash_keys[name] = key

    # ---- planning -------------------------------------------------------------------------------
    def plan(self, step: int) -> StepPlan | None:
        """The next step: every running sequence's next token or chunk, plus the waiting prefills that fit."""
        rows: list[tuple[Sequence, int]] = []  # (sequence, tokens fed)
        running = list(self.running.values())
        if self.priority is not None:  # best first: what has to give way is the worst
            running.sort(key=self.priority.key)
            self.priority.sort(self.waiting)
        decoding = sum(1 for s in running if s.total - s.computed == 1)
        budget = self.max_batch_prefill_tokens - decoding
        budget = min(budget, self.pacing.cap(decoding) or budget)  # None: no cap
        for s in running:  # oldest first; preemption takes the newest
            if s.seq not in self.running:
                continue  # preempted below for an older sequence
            left = s.total - s.computed
            n = 1 if left == 1 else min(left, max(budget, 0))
            if self.whole_images and s.req.images and 0 < n < left:
                n = whole_image_chunk(s.req, s.computed, n)
            if n == 0:
                continue  # a chunked prefill waits for budget
            if not self._grow(s, s.computed + n):
                break  # s itself was preempted: so was everything newer
            if left > 1:
                budget -= n
            rows.append((s, n))
        self._pixels = []  # the admitted sequences' images' pixels (services/scheduler/images.py)
        if self.priority is not None and self.waiting:
            budget += self._outrank(rows, budget)
        new, blocks = self._admit(rows, budget)
        if not rows:
            return None
        drafts = self._drafts(rows, step) if self.drafter else {}
        for s, _ in rows:
            if s.seq not in blocks and len(s.blocks) > s.planned_blocks:
                blocks[s.seq] = s.blocks[s.planned_blocks :]
            s.planned_blocks = len(s.blocks)
        seqs, num_tokens, context_lens, token_ids, sample = [], [], [], [], []
        inflight = self._inflight[step] = []
        decodes = constrained = 0
        for i, (s, n) in enumerate(rows):
            seqs.append(s.seq)
            context_lens.append(s.computed)
            decodes += n == 1 and s.computed >= s.prompt_len  # it feeds one generated token
            token_ids.append(s.tokens(s.computed, s.computed + n))
            k = len(drafts.get(i, ()))
            if k:  # [its last token, d1..dk]: only the last token is its own until the result says more
                token_ids.append(np.asarray(drafts[i], np.int32))
            num_tokens.append(n + k)
            s.computed += n
            sample.append(s.computed == s.total)
            constrained += bool(s.req.grammar) and sample[-1]
            inflight.append((s, s.seq, s.computed, k))
        c = self.counters
        prefills = len(rows) - decodes
        c["steps"] += 1
        c["prefill_rows"] += prefills
        c["decode_rows"] += decodes
        c["joined_steps"] += bool(new and decodes)
        c["constrained_rows"] += constrained
        self.pacing.planned(step, sum(n for _, n in rows if n > 1), decodes)
        self.step_constrained = constrained
        finished, self._to_drop = self._to_drop, []
        trim, self._trim = self._trim, {}
        return StepPlan(
            step=step,
            new=new,
            blocks=blocks,
            finished=finished,
            trim=trim,
            seqs=np.asarray(seqs, np.int32),
            num_tokens=np.asarray(num_tokens, np.int32),
            context_lens=np.asarray(context_lens, np.int32),
            token_ids=np.concatenate(token_ids).astype(np.int32, copy=False),
            sample=np.asarray(sample, np.uint8),
            drafts=np.asarray([len(drafts.get(i, ())) for i in range(len(rows))] if drafts else [], np.int32),
            **plan_pixels(self._pixels),
        )

    def _drafts(self, rows: list, step: int) -> dict[int, list[int]]:
        """The drafter's proposals, trimmed to the step's leftover token budget and the blocks free without
        preempting anyone; the drafted rows' blocks grown for them."""
        proposed = self.drafter.propose(rows)
        budget = self.max_batch_prefill_tokens - sum(n for _, n in rows)
        bs, kept = self.block_size, {}
        for i, drafts in proposed.items():
            s = rows[i][0]
            held = len(s.blocks) * bs - (s.computed + 1)  # slots its blocks hold past the fed token
            spare = max(0, self.allocator.free - self.watermark) * bs
            drafts = drafts[: min(budget, held + spare)]
            if not drafts:
                continue
            need = -(-(s.computed + 1 + len(drafts)) // bs) - len(s.blocks)
            if need > 0:
                s.blocks += self.allocator.allocate(need)
            kept[i] = drafts
            budget -= len(drafts)
            self.counters["draft_tokens"] += len(drafts)
        self.drafter.planned(step, rows, proposed, kept)
        return kept

    def _grow(self, s: Sequence, tokens: int) -> bool:
        """Give `s` the blocks for `tokens`, preempting newer sequences if needed; False if `s` itself went."""
        need = blocks_for(tokens, self.block_size) - len(s.blocks)
        while need > self.allocator.free:
            if self.priority is not None:  # the lowest-ranked (plan() runs them best first, so: not yet planned)
                victim = self.priority.worst(self.running.values())
            else:
                victim = next(reversed(self.running.values()))
            self._preempt(victim)
            if victim is s:
                return False
        if need > 0:
            s.blocks += self.allocator.allocate(need)
        return True

    def _preempt(self, s: Sequence) -> None:
        """Recompute later: give the blocks back (full ones stay cached) and wait at the head of the queue."""
        self._release(s)
        self.by_request[s.req.request_id] = s
        s.blocks, s.hashes, s.computed, s.registered = [], [], 0, 0
        if not s.opened:
            s.prompt_logprobs = []  # the prompt is scored again from its start
            s.prompt_greedy = []
        s.preempted += 1
        self.counters["preemptions"] += 1
        self.waiting.appendleft(s)

    def _outrank(self, rows: list[tuple[Sequence, int]], budget: int) -> int:
        """Priority mode: the best waiting sequences that find the batch full (its size, or the KV blocks) preempt
        the worst running ones they outrank, whose rows leave this step; the prefill budget those rows gave back.
        What fits is judged without prefix-cache hits, so a hit may make one preemption more than needed."""
        order, given_back, preempted = self.priority, 0, False
        running = sorted(self.running.values(), key=order.key, reverse=True)  # worst first
        free = self.allocator.free - self.watermark
        slots = self.max_batch_size - len(self.running)
        for w in list(self.waiting):  # best first
            need = blocks_for(min(w.total, max(budget + given_back, 1)), self.block_size)
            while (slots < 1 or need > free) and running and order.outranks(w, running[0]):
                victim, before = running.pop(0), self.allocator.free
                given_back += sum(n for s, n in rows if s is victim and n > 1)
                rows[:] = [(s, n) for s, n in rows if s is not victim]
                self._preempt(victim)
                self.counters["priority_preemptions"] += 1
                preempted = True
                free += self.allocator.free - before
                slots += 1
            if slots < 1 or need > free:
                break
            slots -= 1
            free -= need
        if preempted:
            order.sort(self.waiting)  # the preempted back in their places, behind what outranked them
        return given_back

    def _admit(self, rows: list[tuple[Sequence, int]], budget: int) -> tuple[list[NewSequence], dict]:
        """Move waiting sequences that fit into the running batch, with a row each; FIFO, all-or-none gating."""
        # the watermark keeps room for running decodes to grow; with none running, the whole cache is there
        picks, free = [], self.allocator.free - (self.watermark if self.running else 0)
        prefill = sum(n for _, n in rows if n > 1)  # prompt tokens the running rows feed in this step
        for s in self.waiting:
            if len(self.running) + len(picks) >= self.max_batch_size or budget <= 0:
                break
            if self.prefill_saturation_tokens and prefill >= self.prefill_saturation_tokens:
                self.counters["saturated_steps"] += 1  # the rest wait a step: the first prompts finish sooner
                break
            cached = self.prefix.lookup(s)
            forked = self.siblings.fork(s, self.running.values(), (p[0] for p in picks), len(cached))
            if forked is None:
                break  # a sibling plans the prompt's blocks in this step: they are forked in the next one
            cached = forked if len(forked) >= len(cached) else cached
            n = min(s.total - len(cached) * self.block_size, budget)
            if self.whole_images and s.req.images and n < s.total - len(cached) * self.block_size:
                n = whole_image_chunk(s.req, len(cached) * self.block_size, n)
            need = blocks_for(len(cached) * self.block_size + n, self.block_size) - len(cached)
            need += self.allocator.unheld(cached)  # held now, they no longer count as free
            if need > free:
                break  # FIFO: the head waits until it fits, as in TGI
            picks.append((s, cached, n))
            free -= need
            budget -= n
            prefill += n
            if n < s.total - len(cached) * self.block_size:
                break  # a partial (chunked) prefill ends the batch, as in TGI
        if self.running and self.max_waiting_tokens:
            self._since_join += 1
            enough = len(picks) >= math.floor(len(self.running) * self.waiting_served_ratio)
            if not enough and self._since_join < self.max_waiting_tokens:
                return [], {}
        if not picks:
            return [], {}
        self._since_join = 0
        new, blocks = [], {}
        for _, cached, _ in picks:  # all hits held first: a pick's new blocks must not evict a later pick's hit
            self.allocator.acquire(cached)
        for s, cached, n in picks:
            self.waiting.popleft()
            self.prefix.count(s, cached)
            self.siblings.count(s, cached)
            s.seq = next(self._handles)
            s.blocks = cached + self.allocator.allocate(
                blocks_for(len(cached) * self.block_size + n, self.block_size) - len(cached)
            )
            s.computed = len(cached) * self.block_size
            s.registered = len(cached)
            s.planned_blocks = len(s.blocks)
            self.running[s.seq] = s
            sampling = s.req.sampling
            if s.opened and sampling.prompt_logprobs:  # a recompute: its prompt logprobs were sent already
                sampling = msgspec.structs.replace(sampling, prompt_logprobs=False)
            prefix = s.tokens(0, s.computed).tolist() if s.computed and sampling.keeps_history() else []
            new.append(NewSequence(s.seq, sampling, prefix, s.req.adapter))
            if s.req.images:  # the images it still feeds travel with it (again after a preemption)
                new[-1].images, pixels = images_to_feed(s.req, s.computed)
                new[-1].cached_images = images_in_prefix(s.req, s.computed)
                self._pixels += pixels
            if s.req.grammar:  # the shard builds its matcher, replaying what it generated already (a recompute)
                new[-1].grammar, new[-1].grammar_ids = s.req.grammar, list(s.output)
            blocks[s.seq] = s.blocks
            self.counters["chunked_prefills"] += n < s.total - s.computed
            rows.append((s, n))
        return new, blocks

    # ---- results --------------------------------------------------------------------------------
    def apply(self, result: StepResult) -> list[Emitted]:
        """Append each row's tokens (a drafted row's accepted ones too), finishing by length (first, as TGI) or EOS
        at the first token that ends it; index the newly full blocks; free the blocks past accepted drafts."""
        inflight = self._inflight.pop(result.step, [])
        if self.drafter is not None:  # the step's time teaches the drafter what a position costs
            self.drafter.timed(result.step, result.forward_s)
        self.pacing.observed(result.step, result.forward_s)
        drafted = {handle: k for _, handle, _, k in inflight if k}
        self._gather_prompt_logprobs(result)
        counts = result.token_counts.tolist() or [1] * len(result.seqs)
        alt_counts = result.top_counts.tolist()  # empty: no token has alternatives
        tokens, logprobs = result.token_ids.tolist(), result.logprobs.tolist()
        top_ids, top_logprobs = result.top_ids.tolist(), result.top_logprobs.tolist()
        rows, ended, at, alt = [], [], 0, 0
        self.step_accepted = []
        for seq, n in zip(result.seqs.tolist(), counts):
            s, first, at = self.running.get(seq), at, at + n
            if s is None:  # finished (aborted) or preempted while the step ran
                alt += sum(alt_counts[first:at])
                continue
            finish, appended = FINISH_NONE, 0
            for j in range(first, at):
                end = alt + (alt_counts[j] if alt_counts else 0)
                alt_ids, alt_logprobs, alt = top_ids[alt:end], top_logprobs[alt:end], end
                if finish:
                    continue  # tokens past the one that ended it are dropped
                s.output.append(tokens[j])
                appended += 1
                if len(s.output) >= s.req.max_new_tokens:
                    finish = FINISH_LENGTH
                elif self.ends(s.req.sampling, tokens[j], len(s.output)):
                    finish = FINISH_EOS
                rows.append(Emitted(s, len(s.output) - 1, tokens[j], logprobs[j], finish, alt_ids, alt_logprobs))
            self.counters["generated"] += appended
            if s.req.adapter:
                self.counters["lora_generated"] += appended
            if seq in drafted:  # the accepted drafts' KV is the tokens just appended
                s.computed += min(n - 1, appended)
                s.drafting.observe(drafted[seq], n - 1)
                self.counters["accepted_tokens"] += n - 1
            if self.drafter is not None:
                self.step_accepted.append(n - 1)
            if finish:
                ended.append(s)
        self.prefix.register(inflight, self.running)
        for s in ended:
            self._release(s)
        for s, handle, _, k in inflight:
            if k and s.seq == handle and handle in self.running:
                self._free_past(s)
        return rows

    def ends(self, sampling: SamplingParams, token: int, generated: int) -> bool:
        """Whether `token`, the `generated`-th, ends its sequence: an EOS (unless ignore_eos) or one of its
        stop_token_ids, once min_tokens are out (the shard masks them before; this holds the rule on its own)."""
        if generated <= sampling.min_tokens:
            return False
        return (token in self.eos_ids and not sampling.ignore_eos) or token in sampling.stop_token_ids

    def _free_past(self, s: Sequence) -> None:
        """Give back the blocks past what a drafted row keeps (its next token's slot); the next plan tells the shard."""
        keep = blocks_for(s.computed + 1, self.block_size)
        if len(s.blocks) > keep:
            self.allocator.release(s.blocks[keep:])
            s.blocks = s.blocks[:keep]
            s.planned_blocks = min(s.planned_blocks, keep)
            self._trim[s.seq] = keep

    def _gather_prompt_logprobs(self, result: StepResult) -> None:
        """Append each fed prompt chunk's logprobs to its sequence (only sequences that asked send any)."""
        logprobs, start = result.prompt_logprobs.tolist(), 0
        greedy = prompt_greedy(result)
        for seq, count in zip(result.prompt_seqs.tolist(), result.prompt_counts.tolist()):
            s = self.running.get(seq)
            if s is not None and not s.opened:  # after the open they could no longer reach the detokenizer
                s.prompt_logprobs.extend(logprobs[start : start + count])
                s.prompt_greedy.extend(greedy[start : start + count])
            start += count

    def finish(self, request_id: str, code: int = FINISH_ABORTED) -> Emitted | None:
        """End a request from outside (abort, stop sequence, failure); the end row, if one is due."""
        s = self.by_request.get(request_id)
        if s is None:
            return None
        if s.seq in self.running and self.running[s.seq] is s:
            self._release(s)
        else:
            self.waiting.remove(s)
            del self.by_request[request_id]
        return Emitted(s, len(s.output), -1, 0.0, code)

    def forget_plans(self) -> None:
        """The plans in flight will not be applied (their step failed or the shard lost its KV)."""
        self._inflight = {}
        self.pacing.forget()

    def requeue_running(self) -> None:
        """The shard lost its KV (it restarted): every running sequence is fed again later, by the preemption path
        (oldest first at the head of the queue; nothing is streamed twice), and the prefix index, whose blocks
        name KV that is gone, is emptied."""
        for s in reversed(list(self.running.values())):
            self._preempt(s)
        self._to_drop, self._inflight, self._trim = [], {}, {}  # the shard starts from a clean slate (the probe)
        self.allocator.forget_cache()  # nothing is held now: every cached block is unheld

    def _release(self, s: Sequence) -> None:
        del self.running[s.seq]
        del self.by_request[s.req.request_id]
        self.allocator.release(s.blocks)
        s.blocks = []
        self._to_drop.append(s.seq)


def prompt_greedy(result: StepResult) -> list[tuple[int, float]]:
    """The (greedy id, logprob) beside each of the result's prompt logprobs; [] when the shard sent none."""
    ids, logprobs = result.prompt_greedy_ids, result.prompt_greedy_logprobs
    if ids is None or logprobs is None or len(ids) == 0:
        return []
    return list(zip(ids.tolist(), logprobs.tolist()))
