"""Tool calls in the model's own format, read back out of its answer (OpenAI chat; the Responses and Anthropic
routes use the same parsers).

One parser per format, one file each: `hermes` (Hermes, Qwen2.5, Qwen3: `<tool_call>{…}</tool_call>`),
`llama3_json` (Llama 3.1/3.2: `{"name": …, "parameters": …}`, after `<|python_tag|>` or not), `mistral`
(`[TOOL_CALLS][{…}]`), `pythonic` (`[f(a=1), g(b=2)]`), `openai` (gpt-oss's harmony: a commentary message
`to=functions.NAME`). vLLM's flag names.

Interface (services.http.tool_parsers.base):
- `native_parser(template, uses_tools, flag, tool_prompt)` → the ToolParser a request is served with, or None:
  TGI's way (its tool prompt and shape) for a template that renders no tools or when the request sends
  `tool_prompt`; the tokenizer and http decide alike from the same template and settings;
- `choose(template, flag)` → the ToolParser for a chat template's text, or the one `--tool-call-parser` names
  (`tgi`: none, TGI's own tool prompt and `{"function": {"_name": …}}` answer); None when the template renders no
  tools or its format is unknown (then TGI's way is used too);
- `parser.parse(text)` → (content or None, [Call(name, arguments JSON text)]): the whole answer;
- `ToolCallStream(parser).push(piece, final)` → [ToolDelta]: content pieces, and per call a first delta with its
  index, id and name, then argument pieces; they assemble to exactly `parse` of the whole text (`finished`: the
  calls with their ids once `final`);
- `parser.grammar(functions, mode, parallel, specials)` → the Lark grammar of the format's calls (mode
  `required`: only calls; `auto`: text, and from the format's trigger on, valid calls), for the tokenizer.
"""

from __future__ import annotations

import re

from services.http.tool_parsers.base import Call, ParsedCall, ToolCallStream, ToolDelta, ToolParser, call_id
from services.http.tool_parsers.harmony import HarmonyToolParser
from services.http.tool_parsers.hermes import HermesParser
from services.http.tool_parsers.llama3_json import Llama3JsonParser
from services.http.tool_parsers.mistral import MistralParser
from services.http.tool_parsers.pythonic import PythonicParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen25": HermesParser,  # vLLM's other names for the same format
    "qwen3_xml": HermesParser,
    "llama3_json": Llama3JsonParser,
    "llama4_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
    "llama4_pythonic": PythonicParser,
    "openai": HarmonyToolParser,
    "harmony": HarmonyToolParser,
}
TGI = "tgi"  # the flag's value for TGI's own tool prompt and answer shape
NAMES = (TGI, *PARSERS)

# what in a template's text gives its format away, first match wins
_SIGNS = (
    (re.compile(r"<\|call\|>|to=functions\."), HarmonyToolParser),
    (re.compile(r"<tool_call>"), HermesParser),
    (re.compile(r"\[TOOL_CALLS\]"), MistralParser),
    (re.compile(r"\[func_name1\(|<\|python_start\|>"), PythonicParser),
    (re.compile(r"<\|python_tag\|>|\"parameters\": |<\|start_header_id\|>ipython"), Llama3JsonParser),
)


def choose(template: str, flag: str = "") -> ToolParser | None:
    """The parser for a chat template (its text) or the one the flag names; None: TGI's tool prompt and shape."""
    if flag == TGI:
        return None
    if flag:
        return PARSERS[flag]()
    for sign, parser in _SIGNS:
        if sign.search(template):
            return parser()
    return None


def native_parser(template: str, uses_tools: bool, flag: str = "", tool_prompt: str | None = None) -> ToolParser | None:
    """The format a request's tools are served in (the tokenizer and http decide alike): the model's own when its
    template renders tools and its format is known (or the flag names one); None (TGI's way) when the template
    knows no tools, the flag is `tgi`, or the request sends TGI's `tool_prompt`."""
    if tool_prompt or flag == TGI or not (uses_tools or flag):
        return None
    return choose(template, flag)


__all__ = [
    "NAMES",
    "PARSERS",
    "Call",
    "call_id",
    "ParsedCall",
    "ToolCallStream",
    "ToolDelta",
    "ToolParser",
    "choose",
    "native_parser",
]
