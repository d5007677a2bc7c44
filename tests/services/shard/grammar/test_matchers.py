"""services.shard.grammar.matchers on the tiny tokenizer with random logits: whatever the (meaningless) scores, the
constrained rows produce outputs that parse and validate, and the matcher follows replay, rollback and errors."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from services.shard.grammar.bitmask import mask_rows, unpack, unpack_on
from services.shard.grammar.matchers import Constraints
from services.tokenizer.grammar import grammar_text, tool_grammar
from tests.tiny_models import BOS, EOS, build_tokenizer

MAX_STEPS = 400

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 10, "maximum": 99},
            "owner": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 8}, "admin": {"type": "boolean"}},
                "required": ["name", "admin"],
            },
            "score": {"type": "number", "minimum": -1, "maximum": 1},
            "note": {"type": "string", "maxLength": 5},  # optional
        },
        "required": ["id", "owner", "score"],
    },
    "array_enum": {
        "type": "array",
        "items": {"enum": ["red", "green", "blue", 3, None]},
        "minItems": 2,
        "maxItems": 4,
    },
    "ref": {
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}},
        "type": "object",
        "properties": {
            "a": {"$ref": "#/$defs/point"},
            "path": {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 2},
        },
        "required": ["a", "path"],
    },
    "any_of": {
        "anyOf": [
            {"type": "integer", "minimum": 0, "maximum": 5},
            {"type": "object", "properties": {"kind": {"const": "x"}}, "required": ["kind"]},
        ]
    },
}


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("constraints-tok")
    build_tokenizer(folder)
    return str(folder / "tokenizer.json")


@pytest.fixture(scope="module")
def cons(tok_path):
    c = Constraints.from_file(tok_path, [EOS])
    yield c
    c.close()


def grammar(value) -> str:
    return grammar_text(value)[1]


def generate(cons: Constraints, keys: list, seed: int, vocab: int | None = None, greedy: bool = False) -> dict:
    """Random logits, masked, sampled, advanced, until every constrained row ends with EOS; the tokens per key."""
    vocab = vocab or cons.tokenizer.vocab_size
    gen = torch.Generator().manual_seed(seed)
    out = {k: [] for k in keys}
    live = list(keys)
    for _ in range(MAX_STEPS):
        if not any(k in cons for k in live):
            break
        logits = torch.randn(len(live), vocab, generator=gen) * 3
        errors = cons.apply(logits, live)
        assert errors == []
        if greedy:
            tokens = logits.argmax(dim=-1).tolist()
        else:
            tokens = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)[:, 0].tolist()
        assert cons.advance(live, tokens) == []
        for k, t in zip(live, tokens):
            if k is not None and k in cons:
                out[k].append(t)
                if t == EOS:
                    cons.discard(k)
    assert not any(k in cons for k in live), "a constrained row did not finish"
    return out


def text(cons: Constraints, tokens: list[int]) -> str:
    assert tokens[-1] == EOS
    return cons.tokenizer.decode_str(tokens[:-1])


@pytest.mark.parametrize("seed", range(3))
def test_json_schemas_validate_whatever_the_logits(cons, seed):
    keys = list(SCHEMAS)
    for k in keys:
        assert cons.open(k, grammar({"type": "json", "value": SCHEMAS[k]})) is None
    out = generate(cons, keys + [None], seed)  # an unconstrained row rides along
    for k in keys:
        value = json.loads(text(cons, out[k]))
        jsonschema.validate(value, SCHEMAS[k])


def test_regex_gbnf_lark_and_tools(cons):
    shapes = {
        "regex": {"type": "regex", "value": r"[0-9]{3}-[a-z]{2,5}( ok)?"},
        "gbnf": 'root ::= "{" ws "\\"answer\\"" ws ":" ws [0-9] [0-9]? ws "}"\nws ::= [ ]?',
        "lark": {"type": "lark", "value": 'start: ("yes" | "no") ("!" | "?")'},
    }
    for k, v in shapes.items():
        cons.open(k, grammar(v))
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {"properties": {"n": {"enum": [1, 2]}}}}},
        {"type": "function", "function": {"name": "g", "parameters": {"properties": {}}}},
    ]
    cons.open("tools", tool_grammar(tools, "required").text)
    out = generate(cons, [*shapes, "tools"], seed=7)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}( ok)?", text(cons, out["regex"]))
    assert re.fullmatch(r'\{ ?"answer" ?: ?[0-9]{1,2} ?\}', text(cons, out["gbnf"]))
    assert re.fullmatch(r"(yes|no)[!?]", text(cons, out["lark"]))
    call = json.loads(text(cons, out["tools"]))
    assert call["function"]["_name"] in ("f", "g")


def test_tool_auto_gives_a_call_or_plain_text(cons):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"n": {"enum": [1, 2]}}}}}]
    auto = tool_grammar(tools, "auto").text
    cons.open("plain", auto)
    cons.open("call", auto, replay=cons.tokenizer.tokenize_str("{"))  # the model chose `{`: a call it must be
    out = generate(cons, ["plain", "call"], seed=3)
    plain = text(cons, out["plain"])
    assert not plain.lstrip().startswith("{")
    call = json.loads("{" + text(cons, out["call"]))
    assert call["function"]["_name"] == "f" and "no_tool" not in json.dumps(call)


def allowed(cons: Constraints, key) -> np.ndarray:
    return unpack(cons.masks([key]), cons.tokenizer.vocab_size)[0].numpy()


def test_eos_only_once_the_grammar_is_complete(cons):
    g = grammar({"type": "regex", "value": "ab(c)?"})
    cons.open("e", g)
    assert not allowed(cons, "e")[EOS]
    for token_text, complete in (("a", False), ("b", True), ("c", True)):
        cons.advance(["e"], cons.tokenizer.tokenize_str(token_text))
        assert cons.is_accepting("e") == complete
        assert allowed(cons, "e")[EOS] == complete
    mask = allowed(cons, "e")  # "abc": nothing may follow but EOS
    assert mask[EOS] and mask.sum() == 1
    cons.discard("e")
    cons.open("e", g, replay=cons.tokenizer.tokenize_str("ab"))
    mask = allowed(cons, "e")  # complete, and "c" may still follow
    assert mask[EOS] and mask[cons.tokenizer.tokenize_str("c")[0]]
    cons.discard("e")


def test_every_eos_id_ends_a_grammar(tok_path):
    c = Constraints.from_file(tok_path, [EOS, BOS])  # a model with two EOS ids
    try:
        for eos in (EOS, BOS):
            c.open(eos, grammar({"type": "regex", "value": "ab"}), replay=c.tokenizer.tokenize_str("ab"))
            mask = unpack(c.masks([eos]), c.tokenizer.vocab_size)[0]
            assert mask[EOS] and mask[BOS] and int(mask.sum()) == 2
            assert c.advance([eos], [eos]) == []
    finally:
        c.close()


def test_replay_and_rebuild_give_the_same_state(cons):
    g = grammar({"type": "json", "value": SCHEMAS["nested"]})
    cons.open("run", g)
    tokens = generate(cons, ["run"], seed=11)["run"]
    for cut in (0, 1, len(tokens) // 2, len(tokens) - 1):
        cons.open("a", g)
        for t in tokens[:cut]:
            cons.advance(["a"], [t])  # step by step, masks filled ahead in between
        cons.open("b", g, replay=tokens[:cut])  # replayed at once (a recompute, a restarted shard)
        cons.open("c", g, replay=tokens[:3])
        cons.rebuild("c", tokens[:cut])
        assert (cons.masks(["a"]) == cons.masks(["b"])).all()
        assert (cons.masks(["a"]) == cons.masks(["c"])).all()
        assert cons.is_accepting("a") == cons.is_accepting("b") == (cut == len(tokens) - 1)
    for k in "abc":
        cons.discard(k)


def test_rollback_returns_to_an_earlier_state(cons):
    g = grammar({"type": "json", "value": SCHEMAS["ref"]})
    cons.open("r", g)
    tokens = generate(cons, ["r"], seed=5)["r"]
    cons.open("r", g, replay=tokens[:10])
    cons.open("s", g, replay=tokens[:6])
    assert cons.rollback("r", 4)
    assert (cons.masks(["r"]) == cons.masks(["s"])).all()
    cons.discard("r")
    cons.discard("s")


def test_masks_filled_ahead_equal_masks_filled_now(cons):
    g = grammar({"type": "json", "value": SCHEMAS["array_enum"]})
    cons.open("x", g)
    start = cons.masks(["x"])
    cons.advance(["x"], cons.tokenizer.tokenize_str("["))  # starts filling the next mask on the worker
    assert cons._ahead is not None
    ahead = cons.masks(["x"])
    assert (ahead == cons.masks(["x"])).all()  # the second call fills it now
    assert allowed(cons, "x")[cons.tokenizer.tokenize_str('"')[0]]
    assert not (ahead == start).all()
    cons.advance(["x"], cons.tokenizer.tokenize_str('"'))
    assert cons.rollback("x", 2)  # the mask filled ahead (after `["`) is stale now: not used
    assert (cons.masks(["x"]) == start).all()
    cons.discard("x")


def test_requests_sharing_a_grammar_compile_it_once_and_steps_use_the_masks_filled_ahead(tok_path):
    """The shard compiles a grammar text once (later requests copy the cached matcher), and after the first step
    every row's mask was filled on the worker while the next forward would run, none on the step's path."""
    c = Constraints.from_file(tok_path, [EOS])
    try:
        text = grammar({"type": "json", "value": SCHEMAS["nested"]})
        for k in range(4):
            assert c.open(("same", k), text) is None
        assert c.open("other", grammar({"type": "regex", "value": "[a-c]{2,4}"})) is None
        assert (c.stats["compiled"], c.stats["reused"]) == (2, 3)
        keys = [("same", k) for k in range(4)] + ["other"]
        out = generate(c, keys, seed=3)
        steps = max(len(tokens) for tokens in out.values())
        assert c.stats["inline_rows"] == len(keys)  # the first step only: nothing had been filled ahead
        assert c.stats["ahead_rows"] == sum(len(tokens) for tokens in out.values()) - len(keys)
        assert steps > 1 and all(c.seconds[phase] > 0 for phase in ("open", "apply", "advance", "fill_ahead"))
    finally:
        c.close()


def test_masks_filled_inline_give_the_same_tokens_as_masks_filled_ahead(tok_path):
    """SWITCHYARD_GRAMMAR_FILL=inline: every mask is filled on the step's path (on all cores), none on the worker,
    and the outputs are token for token those of the default (ahead)."""
    outs = []
    for ahead in (True, False):
        c = Constraints.from_file(tok_path, [EOS], ahead=ahead, threads=None if ahead else 2)
        try:
            keys = list(SCHEMAS)
            for k in keys:
                c.open(k, grammar({"type": "json", "value": SCHEMAS[k]}))
            outs.append(generate(c, keys + [None], seed=5))
            rows = sum(len(tokens) for k, tokens in outs[-1].items() if k is not None)
            if ahead:
                assert c.stats["ahead_rows"] == rows - len(keys) and c.seconds["fill_ahead"] > 0
            else:
                assert c.stats["ahead_rows"] == 0 and c.stats["inline_rows"] == rows and c._ahead is None
        finally:
            c.close()
    assert outs[0] == outs[1]


def test_a_row_with_no_allowed_token_fails_alone(cons):
    g = grammar({"type": "regex", "value": "[0-9]+"})
    cons.open("bad", g)
    cons.open("good", g)
    errors = cons.advance(["good", "bad"], cons.tokenizer.tokenize_str("7") + cons.tokenizer.tokenize_str("x"))
    assert [(e.row, e.key) for e in errors] == [(1, "bad")]
    logits = torch.zeros(3, cons.tokenizer.vocab_size)
    errors = cons.apply(logits, ["good", None, "bad"])
    assert [(e.row, e.key) for e in errors] == [(2, "bad")] and "x" in errors[0].message
    assert torch.isfinite(logits[1]).all()  # the unconstrained row is untouched
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [EOS]  # the failed row can only end
    finite = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert EOS in finite and all(cons.tokenizer.decode_str([t]).isdigit() for t in finite if t != EOS)
    torch.multinomial(torch.softmax(logits, dim=-1), 1)  # the batch still samples
    cons.discard("bad")
    cons.discard("good")


def test_a_grammar_that_does_not_compile_is_reported_at_apply(cons):
    assert "unknown name" in cons.open("broken", '{"grammars": [{"lark_grammar": "start: nope"}]}')
    errors = cons.apply(torch.zeros(1, cons.tokenizer.vocab_size), ["broken"])
    assert errors[0].key == "broken"
    cons.discard("broken")


def test_logits_wider_than_the_vocabulary_mask_the_extra_ids(cons):
    vocab = cons.tokenizer.vocab_size
    cons.open("w", grammar({"type": "regex", "value": "a+"}))
    logits = torch.zeros(1, vocab + 40)
    cons.apply(logits, ["w"])
    assert torch.isinf(logits[0, vocab:]).all()
    out = generate(cons, ["w"], seed=1, vocab=vocab + 40, greedy=True)["w"]
    assert re.fullmatch("a+", text(cons, out))


def test_unpack_matches_the_bit_layout():
    rng = np.random.default_rng(0)
    bits = rng.integers(-(2**31), 2**31, size=(3, 5), dtype=np.int64).astype(np.int32)
    want = np.array([[(int(w) >> b) & 1 for w in row for b in range(32)] for row in bits], dtype=bool)
    assert (unpack(bits, 160).numpy() == want).all()
    assert (unpack(bits, 150).numpy() == want[:, :150]).all()
    padded = unpack(bits, 170).numpy()
    assert (padded[:, :160] == want).all() and not padded[:, 160:].any()
    blocked = unpack(bits, 170, blocked=True).numpy()
    assert (blocked == ~padded).all()
    # the accelerator path (torch shifts), run on the CPU here
    assert (unpack_on(bits, "cpu").numpy() == want).all()
    assert (unpack_on(bits, "cpu", blocked=True).numpy() == ~want).all()


@pytest.mark.parametrize("width", [150, 160, 170])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # numpy's writes, torch's
def test_mask_rows_equals_a_full_bool_mask(width, strided, dtype):
    """The packed-word writes (blocked side of dense rows, kept side of sparse ones) against masked_fill."""
    rng = np.random.default_rng(width)
    dense = rng.random((2, 160)) < 0.97  # inside a string: almost everything allowed
    sparse = rng.random((2, 160)) < 0.03  # at punctuation: a few ids
    allowed = np.concatenate([dense, sparse, np.zeros((1, 160), bool)])
    allowed[4, 7] = True  # the last row allows one id only
    bits = np.packbits(allowed, axis=1, bitorder="little").view(np.uint32)
    rows = [0, 2, 3, 5, 6]  # rows 1 and 4 of the logits are unconstrained
    base = (torch.randn(7, width + 3) if strided else torch.randn(7, width)).to(dtype)
    logits = base[:, :width]
    want = logits.clone()
    full = unpack(bits.view(np.int32), width).numpy()
    for j, row in enumerate(rows):
        want[row].masked_fill_(~torch.from_numpy(full[j]), float("-inf"))
    mask_rows(logits, rows, bits)
    assert torch.equal(logits, want)
    kept = [int(torch.isfinite(logits[r]).sum()) for r in rows]
    assert kept[0] > width // 2 and 0 < kept[2] < width // 2 and kept[4] == 1  # both sides were taken


def test_set_fill_switches_where_the_masks_are_filled(tok_path):
    c = Constraints.from_file(tok_path, [EOS])
    try:
        c.open("x", grammar({"type": "json", "value": SCHEMAS["array_enum"]}))
        c.set_fill(False, 2)
        c.masks(["x"])
        c.advance(["x"], c.tokenizer.tokenize_str("["))
        assert c._ahead is None  # inline: nothing started on the worker
        c.set_fill(True)
        c.advance(["x"], c.tokenizer.tokenize_str('"'))
        assert c._ahead is not None
    finally:
        c.close()


def test_a_drafted_rows_masks_follow_its_drafts_and_leave_the_matcher_where_it_was(cons):
    """Speculative decoding: pick j of a drafted row is masked by the grammar after its first j drafts (one
    llguidance call for the chain); a draft the grammar refuses ends the chain (the picks after it get the last
    mask, not an empty one, which would report an error); the matcher is rolled back to where it was."""
    g = grammar({"type": "json", "value": SCHEMAS["nested"]})
    cons.open("run", g)
    tokens = generate(cons, ["run"], seed=5)["run"]
    start = 3
    cons.open("step", g, replay=tokens[:start])
    one_by_one = []
    for t in tokens[start : start + 5]:
        one_by_one.append(cons.masks(["step"])[0])
        cons.advance(["step"], [t])
    one_by_one.append(cons.masks(["step"])[0])
    cons.open("d", g, replay=tokens[:start])
    before = cons.masks(["d"])
    drafts = tokens[start : start + 5]
    chain = cons.masks(["d"] * 6, [(drafts, j) for j in range(6)])
    assert (chain == np.stack(one_by_one)).all()
    assert (cons.masks(["d"]) == before).all()  # rolled back
    refused = [drafts[0], EOS, drafts[1]]  # EOS is not allowed mid-object
    chain = cons.masks(["d"] * 4, [(refused, j) for j in range(4)])
    assert (chain[:2] == np.stack(one_by_one[:2])).all()
    assert (chain[2] == chain[1]).all() and (chain[3] == chain[1]).all()
    logits = torch.zeros(5, cons.tokenizer.vocab_size)  # through apply, a plain row beside the drafted one
    assert cons.apply(logits, ["d", "d", "d", "d", None], drafts=[(refused, j) for j in range(4)] + [None]) == []
    assert torch.isfinite(logits[4]).all() and not torch.isfinite(logits[0]).all()
    assert cons.stats["draft_rows"] >= 5 + 3 + 3
    for k in ("run", "step", "d"):
        cons.discard(k)
