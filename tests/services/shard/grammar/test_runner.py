"""Greedy constrained rows chosen among their grammar's few allowed ids (sampler.choose with a GrammarMask): the
same tokens, logprobs and alternatives as masking the whole row first, in float32 and bf16, beside sampled,
top-n and unconstrained rows; the rows taken that way are never written, and bf16 logits get no float32 copy."""

from __future__ import annotations

import pytest
import torch

from libs.protocol.params import SamplingParams
from services.shard.grammar.matchers import Constraints
from services.shard.grammar.runner import GrammarMask
from services.shard.sampling import sampler
from services.tokenizer.grammar import grammar_text
from tests.tiny_models import EOS, build_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 10, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["id", "tags", "note"],
}


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("constraints-sparse-tok")
    build_tokenizer(folder)
    return str(folder / "tokenizer.json")


def _whole_row_mask(cons: Constraints, keys: list, errors: dict):
    """The reference: every constrained row masked in full (a plain callable: no `split`)."""

    def constrain(scores: torch.Tensor) -> None:
        for e in cons.apply(scores, keys):
            errors[int(e.key)] = e.message

    return constrain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_rows_choose_what_the_whole_masked_row_chose(tok_path, dtype):
    cons = Constraints.from_file(tok_path, [EOS], ahead=False)
    try:
        vocab = cons.tokenizer.vocab_size + 5  # a padded vocabulary: ids past the bitmask are never allowed
        text = grammar_text({"type": "json", "value": SCHEMA})[1]
        # rows: greedy (sparse-capable) x3, greedy with alternatives, seeded draw, greedy unconstrained
        keys = [0, 1, 2, 3, 4, None]
        params = [SamplingParams()] * 3 + [
            SamplingParams(top_n_tokens=3),
            SamplingParams(do_sample=True, seed=7),
            SamplingParams(),
        ]
        for k in keys:
            if k is not None:
                cons.open(k, text)
        gen = torch.Generator().manual_seed(11)
        sparse_steps = 0
        for step in range(60):
            if not any(k in cons for k in keys[:5]):
                break
            step_keys = [k if k is not None and k in cons else None for k in keys]
            logits = (torch.randn(len(keys), vocab, generator=gen) * 3).to(dtype)
            before = cons.stats["sparse_rows"]
            got_errors, want_errors = {}, {}
            logits_sparse = logits.clone()
            got = sampler.choose(
                logits_sparse,
                params,
                [torch.Generator().manual_seed(step) for _ in keys],
                constrain=GrammarMask(cons, step_keys, got_errors),
            )
            taken = cons.stats["sparse_rows"] - before
            want = sampler.choose(
                logits.clone(),
                params,
                [torch.Generator().manual_seed(step) for _ in keys],
                constrain=_whole_row_mask(cons, step_keys, want_errors),
            )
            assert got.token_ids.tolist() == want.token_ids.tolist()
            torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=2e-6)
            assert got.top_counts.tolist() == want.top_counts.tolist()
            assert got.top_ids.tolist() == want.top_ids.tolist()
            torch.testing.assert_close(got.top_logprobs, want.top_logprobs, rtol=0, atol=2e-6)
            assert got_errors == want_errors == {}
            # constrained rows left as they came are the sparse ones (greedy rows without alternatives only); a
            # row masked in full always changes (the padded ids at least)
            untouched = [
                i for i, k in enumerate(step_keys) if k is not None and torch.equal(logits_sparse[i], logits[i])
            ]
            assert set(untouched) <= {0, 1, 2} and len(untouched) == taken
            sparse_steps += taken > 0
            assert cons.advance(step_keys, got.token_ids.tolist()) == []
            for k, t in zip(step_keys, got.token_ids.tolist()):
                if k is not None and t == EOS:
                    cons.discard(k)
        assert sparse_steps >= 5  # the sparse path fired, on many steps
    finally:
        cons.close()


def test_constrained_bf16_rows_get_no_full_float32_copy(tok_path, monkeypatch):
    """bf16 logits with only a grammar (no processors or warpers) are masked in place: no [rows, vocab] float32
    tensor is made by `.float()`, whether the rows go the sparse way or are masked in full."""
    cons = Constraints.from_file(tok_path, [EOS], ahead=False)
    try:
        vocab = cons.tokenizer.vocab_size
        text = grammar_text({"type": "json", "value": SCHEMA})[1]
        keys = [0, 1, None]
        for k in (0, 1):
            cons.open(k, text)
        logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(2)).bfloat16()
        want = logits.float()
        cons.apply(want, keys)
        made: list[tuple[int, ...]] = []
        real_float = torch.Tensor.float
        monkeypatch.setattr(
            torch.Tensor, "float", lambda self, *a, **k: made.append(tuple(self.shape)) or real_float(self)
        )
        params = [SamplingParams(), SamplingParams(top_n_tokens=2), SamplingParams()]
        c = sampler.choose(logits, params, [None] * 3, constrain=GrammarMask(cons, keys, {}))
        assert (3, vocab) not in made
        assert c.token_ids.tolist() == want.argmax(-1).tolist()
        lp = torch.log_softmax(want.double(), -1).gather(-1, c.token_ids[:, None])[:, 0]
        torch.testing.assert_close(c.logprobs.double(), lp, rtol=0, atol=1e-6)
        assert cons.stats["sparse_rows"] == 1  # row 0 (row 1 asks for alternatives: masked in full)
        assert torch.isinf(logits[1]).any() and not torch.isinf(logits[0]).any()
    finally:
        cons.close()
