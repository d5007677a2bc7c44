"""TGI's tool calls for OpenAI chat: reading the call out of the generated text, whole or as stream deltas.

The tokenizer selects the tools by `tool_choice` and compiles the grammar that forces the answer
(services.tokenizer.grammar.tool_grammar): `{"function": {"_name": <name>, <arguments…>}}`, `_name` first. Under
`auto` (or no tool_choice) the grammar is "a call, or plain text that does not start with `{`", in one pass: the
answer is a tool call exactly when its first non-blank character is `{`, so a client never sees a `no_tool`
object and nothing is generated twice (TGI re-runs generation for `no_tool`).

`arguments` is the generated text of the arguments object as the model wrote it (after `_name`), so the pieces a
stream sends add up to exactly the non-streamed answer. The tool structs are in services.http.openai.requests
(what a client declares) and services.http.openai.responses (the calls written).
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import orjson

from services.http.errors import Failure
from services.http.openai.responses import ToolCall, ToolCallFunction

# The head of a call, up to the character after the name: `,` (arguments follow) or `}` (none).
HEAD = re.compile(r'\s*\{\s*"function"\s*:\s*\{\s*"_name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*([,}])')
BLANK = " \t\r\n"


def tool_error(message: str) -> Failure:
    return Failure(f"Tool error: {message}", "tool_error")


def tool_mode(tools: list | None, tool_choice: Any) -> str | None:
    """How the answer is read: None (no tools: plain content), "auto" (a call or content), "call" (a call)."""
    if not tools:
        return None
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else tool_choice
    if name == "none":
        return None
    return "auto" if name in (None, "auto") else "call"


def next_call_id(messages: list[dict[str, Any]]) -> str:
    """TGI's tool-call id: one more than the largest numeric id of the conversation's earlier calls ("0" when
    there are none); a UUID when an earlier id is not a number."""
    ids = [
        call.get("id")
        for m in messages
        if isinstance(m, dict)
        for call in (m.get("tool_calls") or [])
        if isinstance(call, dict)
    ]
    if not ids:
        return "0"
    if all(isinstance(i, str) and i.isdigit() for i in ids):
        return str(max(int(i) for i in ids) + 1)
    return str(uuid.uuid4())


def visible_text(rows: list) -> str:
    """The answer's text as TGI's tool mode reads it, whole as streamed: its tokens' texts without the special ones.
    Where the detokenizer keeps special tokens in the text (a format written in them, gpt-oss's harmony), the final
    generated_text holds them; TGI's grammar writes none, so only the end-of-turn token is left out."""
    return "".join("" if row.special else row.text for row in rows)


def is_call(text: str) -> bool:
    """Under `auto`: the answer is a call exactly when its first non-blank character is `{`."""
    return text.lstrip(BLANK).startswith("{")


def _arguments_start(head: re.Match) -> int:
    """Where the arguments text starts: after the `,` that follows the name, or at the `}` closing a call without
    arguments (the arguments are then `{}`)."""
    return head.end() if head.group(2) == "," else head.end() - 1


def _arguments_end(text: str, start: int) -> int:
    """The end of the arguments text in a complete call: before the outer object's closing `}`."""
    body = text[start:].rstrip(BLANK)
    return start + len(body[:-1].rstrip(BLANK))


def parse_tool_call(generated_text: str, call_id: str = "0") -> list[ToolCall]:
    """The non-stream answer: {"function": {"_name": …, …}} → one tool call (TGI's shape)."""
    try:
        value = orjson.loads(generated_text)
    except orjson.JSONDecodeError as e:
        raise tool_error(f"Failed to parse generated text: {e} {generated_text!r}") from None
    function = value.get("function") if isinstance(value, dict) else None
    if not isinstance(function, dict):
        raise tool_error("No function found in generated text")
    name = function.get("_name")
    if not isinstance(name, str):
        raise tool_error("No _name found in generated text")
    head = HEAD.match(generated_text)
    if head is not None:
        start = _arguments_start(head)
        arguments = "{" + generated_text[start : _arguments_end(generated_text, start)]
    else:  # `_name` not first (a grammar always puts it first): the arguments as compact JSON
        arguments = orjson.dumps({k: v for k, v in function.items() if k != "_name"}).decode()
    return [ToolCall(id=call_id, type="function", function=ToolCallFunction(None, name, arguments))]


class ToolStream:
    """A chat stream's tokens → deltas: ("content", text) or ("call", name, arguments piece).

    `auto`: blanks are held until the first visible character decides (content, or a call on `{`). A call is
    held until its name is complete; its first delta names it with arguments `{`, the next ones carry the
    arguments text as it comes, holding back what may be the closing braces, so the pieces add up to exactly the
    non-streamed arguments (TGI trims the final `}` the same way).
    """

    def __init__(self, auto: bool) -> None:
        self.auto = auto
        self.text = ""
        self.mode: str | None = None  # None: undecided | "content" | "head" (name not complete) | "call"
        self.start = self.sent = 0  # the arguments text: where it starts, and how much of it was sent

    def push(self, piece: str, final: bool) -> list[tuple]:
        """The deltas for one more token's text (`final`: the stream's last token)."""
        before = len(self.text)
        self.text += piece
        out: list[tuple] = []
        if self.mode is None:
            visible = self.text.lstrip(BLANK)
            if self.auto and visible and not visible.startswith("{"):
                self.mode = "content"
                before = 0  # the blanks held so far go out with it
            elif visible:
                self.mode = "head"
            elif final and self.auto:
                self.mode, before = "content", 0
        if self.mode is None and final:  # a forced call that never began (cut by max_tokens)
            raise tool_error(f"Failed to parse generated text: {self.text!r}")
        if self.mode == "content":
            if len(self.text) > before or final:
                out.append(("content", self.text[before:]))
            return out
        if self.mode == "head":
            head = HEAD.match(self.text)
            if head is None:
                if final:
                    raise tool_error(f"Failed to parse generated text: {self.text!r}")
                return out
            name = orjson.loads(f'"{head.group(1)}"')
            self.mode, self.start = "call", _arguments_start(head)
            self.sent = self.start
            out.append(("call", name, "{"))
        if self.mode == "call":
            if final:
                try:
                    orjson.loads(self.text)
                except orjson.JSONDecodeError as e:
                    raise tool_error(f"Failed to parse generated text: {e} {self.text!r}") from None
                end = _arguments_end(self.text, self.start)
            else:  # hold back the trailing blanks and braces: the last `}` is not part of the arguments
                end = self.start + len(self.text[self.start :].rstrip(BLANK + "}"))
            if end > self.sent or (final and not out):
                out.append(("call", None, self.text[self.sent : max(end, self.sent)]))
                self.sent = max(end, self.sent)
        return out
