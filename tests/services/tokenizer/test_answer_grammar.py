"""The grammar of an answer in the model's own format (llguidance against the tiny tokenizer): forced calls in the
format's syntax with no free whitespace, `auto` free until the trigger and valid after it, a thinking budget."""

from __future__ import annotations

import pytest
from llguidance import LLMatcher, LLTokenizer
from tokenizers import Tokenizer

from services.http.tool_parsers import PARSERS
from services.tokenizer.answer_grammar import budget_lark, compiled, json_answer_lark, marker_token, tool_plan
from services.tokenizer.grammar import ToolError
from tests.tiny_models import EOS, build_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {"type": "function", "function": {"name": "now"}},
]
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    path = str(out / "tokenizer.json")
    return Tokenizer.from_file(path), LLTokenizer(path, eos_token=[EOS])


def _accepts(vocab, grammar: str, text: str) -> bool:
    tok, lltok = vocab
    matcher = LLMatcher(lltok, compiled(grammar), log_level=0)
    ok = all(matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False).ids)
    return ok and matcher.is_accepting()


def test_required_and_named_calls(vocab):
    hermes = PARSERS["hermes"]()
    required = tool_plan(hermes, TOOLS, "required", parallel=False).lark
    assert _accepts(vocab, required, f"<tool_call>\n{CALL}\n</tool_call>")
    assert not _accepts(
        vocab, required, '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    )
    assert not _accepts(vocab, required, "Sure.")  # a call is required
    assert not _accepts(vocab, required, f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL}\n</tool_call>")
    named = tool_plan(hermes, TOOLS, {"type": "function", "function": {"name": "now"}}).lark
    assert _accepts(vocab, named, '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    assert not _accepts(vocab, named, f"<tool_call>\n{CALL}\n</tool_call>")
    llama = tool_plan(PARSERS["llama3_json"](), TOOLS, "required").lark
    assert _accepts(vocab, llama, '{"name": "get_weather", "parameters": {"city": "Oslo"}}')


def test_auto_is_free_until_the_trigger(vocab):
    auto = tool_plan(PARSERS["hermes"](), TOOLS, "auto").lark
    assert _accepts(vocab, auto, "Just an answer.")
    assert _accepts(vocab, auto, f"Let me look.\n<tool_call>\n{CALL}\n</tool_call>")
    assert not _accepts(vocab, auto, '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>')
    assert tool_plan(PARSERS["hermes"](), TOOLS, "none").lark is None  # the template sees the tools; free text


def test_bad_tool_choice_and_schema():
    with pytest.raises(ToolError, match="Tool with name nope not found"):
        tool_plan(PARSERS["hermes"](), TOOLS, {"type": "function", "function": {"name": "nope"}})
    bad = [{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}]
    with pytest.raises(ToolError, match="must be a JSON schema object"):
        tool_plan(PARSERS["hermes"](), bad, "required")


def test_thinking_budget_forces_the_end_marker(vocab):
    tok, lltok = vocab
    tools = tool_plan(PARSERS["hermes"](), TOOLS, "required").lark
    # the model's own `</think>` within the budget (its tokens count while they may still be reasoning)
    assert _accepts(vocab, budget_lark("</think>", 12, tools), f"a b</think><tool_call>\n{CALL}\n</tool_call>")
    assert not _accepts(vocab, budget_lark("</think>", 12, tools), "a b</think>free text")  # the answer: a call
    grammar = budget_lark("</think>", 3, tools)
    matcher = LLMatcher(lltok, compiled(grammar), log_level=0)
    ids = tok.encode("a b c d e", add_special_tokens=False).ids
    assert all(matcher.consume_token(t) for t in ids[:3])
    assert not matcher.consume_token(ids[3])  # at the budget only `</think>` may follow


def test_reasoning_may_hold_the_markers_first_character(vocab):
    # without a budget: `<` in the reasoning, even a marker's prefix, then the model's own `</think>` still hands over
    free = budget_lark("</think>", None)
    assert _accepts(vocab, free, "if a < b then </thi no</think>answer")
    assert not _accepts(vocab, budget_lark("</think>", None), "no end marker")  # the answer follows the marker


def test_a_json_answer_after_the_reasoning(vocab):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    grammar = budget_lark("</think>", 40, json_answer_lark(schema))
    assert _accepts(vocab, grammar, 'x y</think>{"n": 3}')
    assert not _accepts(vocab, grammar, 'x</think>{"n": "three"}')
    assert not _accepts(vocab, grammar, 'x</think>{"n": 3, "extra": 1}')  # extra keys closed
    assert _accepts(vocab, budget_lark("</think>", None, json_answer_lark(schema)), 'a</think>{"n": 1}')


@pytest.mark.parametrize("special", [True, False])
def test_under_a_budget_reasoning_may_hold_lt_where_the_marker_is_one_token(tmp_path, special):
    # a tokenizer with `</think>` as one added token (special as some models have it, or not as Qwen3's)
    tok, _ = _tokenizer_with(tmp_path, "</think>", special)
    lltok = LLTokenizer(str(tmp_path / "tokenizer.json"), eos_token=[EOS])
    end_id = marker_token(tok, "</think>")
    assert end_id == tok.token_to_id("</think>")
    assert marker_token(tok, "<|no such marker|>") is None
    grammar = compiled(budget_lark("</think>", 6, None, end_id))

    def run(text: str, n: int) -> tuple[list[int], LLMatcher]:
        matcher = LLMatcher(lltok, grammar, log_level=0)
        ids = tok.encode(text, add_special_tokens=False).ids[:n]
        assert all(matcher.consume_token(t) for t in ids)
        return ids, matcher

    taken, matcher = run("a<b c<d e f", 6)  # `<` in the reasoning up to the budget (6 tokens)
    assert tok.decode(taken) == "a<b c<d"
    assert matcher.compute_ff_tokens() == [end_id]  # only the marker's token may follow: the server writes it
    taken, matcher = run("if a < b</think>the answer < 3", 99)  # the model's own marker within the budget
    assert end_id in taken and matcher.is_accepting()
    # the marker's text written in pieces does not close (or hide in) the reasoning: only its token does
    pieces = [i for ch in "x</think>" for i in tok.encode(ch, add_special_tokens=False).ids]
    assert LLMatcher(lltok, grammar, log_level=0).validate_tokens(pieces) < len(pieces)


def _tokenizer_with(path, marker: str, special: bool):
    from tokenizers import AddedToken

    build_tokenizer(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_tokens([AddedToken(marker, special=special, normalized=False)])
    tok.save(str(path / "tokenizer.json"))
    return tok, None


def test_harmony_analysis_under_a_budget_then_the_call(tmp_path):
    from services.http.reasoning import HarmonyParser
    from services.tokenizer.answer_grammar import reasoning_lark
    from tests.harmony_model import build_harmony_tokenizer

    tok = build_harmony_tokenizer(tmp_path)
    lltok = LLTokenizer(str(tmp_path / "tokenizer.json"), eos_token=[tok.token_to_id("<|call|>")])
    specials = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    tools = tool_plan(PARSERS["openai"](), TOOLS, "required", specials=specials).lark
    grammar = compiled(reasoning_lark(HarmonyParser(), tok, 4, tools, calls=True))
    call = "<|channel|>commentary to=functions.now <|constrain|>json<|message|>{}<|call|>"

    def accepts(text: str) -> bool:
        matcher = LLMatcher(lltok, grammar, log_level=0)
        return all(matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False).ids)

    assert accepts(f"<|channel|>analysis<|message|>a < b<|end|><|start|>assistant{call}")
    # without a budget the answer may open with analysis and a commentary preamble, then the call
    free = compiled(tools)
    lead = "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>commentary<|message|>Let me see.<|end|>"
    for text, ok in ((f"{lead}<|start|>assistant{call}", True), (call, True), (lead, False)):
        matcher = LLMatcher(lltok, free, log_level=0)
        ids = tok.encode(text, add_special_tokens=False).ids
        assert (all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()) == ok, text
    assert not accepts(f"<|channel|>analysis<|message|>a < b c d e<|end|><|start|>assistant{call}")  # over budget
    assert not accepts("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>no call")
    matcher = LLMatcher(lltok, grammar, log_level=0)
    ids = tok.encode("<|channel|>analysis<|message|>a < b c", add_special_tokens=False).ids
    assert all(matcher.consume_token(t) for t in ids[:-1])  # 4 tokens of analysis: `<|end|>` is forced next
    assert tok.decode(matcher.compute_ff_tokens(), skip_special_tokens=False).startswith("<|end|><|start|>assistant")


def test_the_processor_names_a_one_token_marker_by_id(tmp_path):
    # a Qwen3-like tokenizer (`</think>` one added token, not special) and DeepSeek-R1's template (the prompt opens
    # the reasoning): the budget's grammar lets the reasoning hold `<`, and forces the marker's token at the budget
    from pathlib import Path

    from libs.runtime.settings import Settings
    from services.tokenizer.processor import Processor
    from tests.services.tokenizer.conftest import request

    tok, _ = _tokenizer_with(tmp_path, "</think>", special=False)
    template = Path(__file__).parents[2] / "data" / "chat_templates" / "deepseek_r1.jinja"
    (tmp_path / "chat_template.jinja").write_text(template.read_text(encoding="utf-8"), encoding="utf-8")
    processor = Processor.from_settings(Settings(model_path=str(tmp_path), max_total_tokens=400))
    try:
        req = request(messages=[{"role": "user", "content": "Why?"}], max_new_tokens=20)
        req.thinking_budget = 3
        grammar = processor.process(req).grammar
    finally:
        processor.close()
    matcher = LLMatcher(LLTokenizer(str(tmp_path / "tokenizer.json"), eos_token=[EOS]), grammar, log_level=0)
    assert all(matcher.consume_token(t) for t in tok.encode("a<b", add_special_tokens=False).ids)
    assert matcher.compute_ff_tokens()[:1] == [tok.token_to_id("</think>")]
