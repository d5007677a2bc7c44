"""Chat templates, as TGI applies them (router/src/infer/chat_template.rs), rendered with jinja2's sandbox.

TGI renders with minijinja; we render with jinja2's ImmutableSandboxedEnvironment set up as `transformers` does
(trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that does not escape
HTML), since the Hub's templates are written for that. TGI's input shaping is kept: message content is flattened
to one string (text parts joined, images as `![](url)`, tool calls as JSON), only role and content reach the
template, and a final assistant message is continued rather than closed.

The model's own way (`render(..., native=True)`, used where the template has a known tool-call format, see
services.http.tool_parsers) passes everything a template reads, as `transformers.apply_chat_template` does:
`tools` (the request's list), assistant messages with `tool_calls` (arguments as a dict: the JSON string a client
sends is parsed, `InvalidMessage` when it is not JSON), `tool` messages with `tool_call_id` and `name`, content parts
as a list where the template iterates over content (else their text joined, as TGI), `chat_template_kwargs`
(e.g. `enable_thinking`) and `documents`. An assistant turn's earlier reasoning, sent as `reasoning_content`,
`reasoning` or `thinking`, reaches the template under all three names (Qwen3's template reads
`reasoning_content`, gpt-oss's `thinking`, vLLM passes `reasoning`); each template decides which turns show it.
Keys whose value is null are dropped (a template tests `is defined`).
`native_messages` is that shaping alone; `probe(kwargs)` renders a one-message chat (its generation prompt shows
whether reasoning opens in the prompt).
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

# TGI's rewrites of Hub templates (chat_template.rs): content is a string here, so the multimodal lookup
# `messages[0]['content'][0]['text']` becomes the content itself; the training-only `{% generation %}` tags go.
_REWRITES = (
    (re.compile(r"messages\[0\]\['content'\]\[0\]\['text'\]"), "messages[0]['content']"),
    (re.compile(r"\{%-?\s*(?:end)?generation\s*-?%\}"), ""),
)
# appended to a final assistant message to find where its content ends in the rendered text (as transformers)
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class TemplateError(Exception):
    """TGI's InferError::TemplateError: 422, error_type `template_error`, message `Template error: {detail}`."""

    error_type = "template_error"

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail

    @property
    def full_message(self) -> str:
        return f"Template error: {self.detail}"


# minijinja's error for a missing template (ErrorKind::TemplateNotFound, no detail), which TGI reports as is
NOT_FOUND = TemplateError("template not found")


class InvalidMessage(TemplateError):
    """A message the model's template cannot be given (e.g. tool call arguments that are not JSON): 422."""

    error_type = "validation"

    @property
    def full_message(self) -> str:
        return self.detail


class _Raised(Exception):
    """raise_exception() from a template: TGI maps it to minijinja's ErrorKind::SyntaxError."""


# TGI's default_tool_prompt (appended to the last message of a request with tools)
DEFAULT_TOOL_PROMPT = (
    "\nGiven the functions available, please respond with a JSON for a function call with its proper arguments that "
    "best answers the given prompt. Respond in the format {name: function name, parameters: dictionary of argument "
    "name and its value}.Do not use variables.\n"
)


def _raise_exception(message: str) -> None:
    raise _Raised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes <, >, & for HTML; chat templates need the plain JSON (as transformers does)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _template_line(exc: BaseException) -> int | None:
    """The template line a render error came from: jinja2 rewrites traceback frames to the template's lines."""
    line, tb = None, exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _detail(exc: Exception) -> str:
    """minijinja's wording for the error (kind, then detail, then location), as TGI shows it."""
    if isinstance(exc, jinja2.TemplateSyntaxError):
        return f"syntax error: {exc.message} (in <string>:{exc.lineno})"
    if isinstance(exc, _Raised):
        kind = "syntax error"
    elif isinstance(exc, jinja2.UndefinedError):
        kind = "undefined value"
    elif isinstance(exc, (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)):
        kind = "invalid operation"
    else:
        kind = "error"
    line = _template_line(exc)
    return f"{kind}: {exc}" + (f" (in <string>:{line})" if line is not None else "")


def flatten_content(message: dict[str, Any]) -> str:
    """TGI's Message → TextMessage content: one string (lib.rs, `From<Message> for TextMessage`)."""
    content = message.get("content")
    if content is None and message.get("tool_calls") is not None:
        return json.dumps(message["tool_calls"], separators=(",", ":"), ensure_ascii=False)  # serde_json's form
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if not isinstance(part, dict):
            continue
        if part.get("type") == "image_url" or "image_url" in part:
            url = part.get("image_url") or {}
            parts.append(f"![]({url.get('url', '') if isinstance(url, dict) else url})")
        elif isinstance(part.get("text"), str):
            parts.append(part["text"])
    return "".join(parts)


# a template that loops over a message's content reads content parts (a list); others read one string
_READS_PARTS = re.compile(r"for\s+\w+\s+in\s+[\w.\[\]'\"]*content\b")


def _no_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _no_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_no_nulls(v) for v in value]
    return value


def _arguments(arguments: Any, where: str) -> Any:
    """A tool call's arguments for the template: a dict (the JSON text a client sends, parsed)."""
    if not isinstance(arguments, str):
        return arguments if arguments is not None else {}
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except ValueError as e:
        raise InvalidMessage(f"{where}.function.arguments is not valid JSON: {e}") from None


# the names an assistant turn's reasoning goes by, the first given wins (see the module docstring)
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


def _with_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message with its reasoning (if any) under every name in REASONING_KEYS; but gpt-oss's template
    refuses `thinking` beside content in a tool-call turn (it shows that content as the turn's analysis), so there
    `thinking` is only what the client sent under that name."""
    text = next((message[k] for k in REASONING_KEYS if isinstance(message.get(k), str) and message[k]), None)
    if text is None or message.get("role") != "assistant":
        return message
    keys = REASONING_KEYS
    if message.get("tool_calls") and message.get("content") and "thinking" not in message:
        keys = REASONING_KEYS[:2]
    return {**message, **dict.fromkeys(keys, text)}


def native_messages(messages: list[dict[str, Any]], content_parts: bool) -> list[dict[str, Any]]:
    """Messages as transformers' templates read them (see the module docstring)."""
    out = []
    for i, message in enumerate(messages):
        m = _with_reasoning(_no_nulls(dict(message)))
        content = m.get("content")
        if isinstance(content, list) and not content_parts:
            m["content"] = flatten_content(m)
        elif isinstance(
            content, list
        ):  # transformers' image part, which a multimodal template writes as its image token
            m["content"] = [_image_part(part) for part in content]
        for j, call in enumerate(m.get("tool_calls") or []):
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and "arguments" in function:
                where = f"messages[{i}].tool_calls[{j}]"
                call["function"] = {**function, "arguments": _arguments(function["arguments"], where)}
        out.append(m)
    return out


def image_part_url(part: Any) -> str | None:
    """The URL of an OpenAI image_url content part (None: not one)."""
    if not isinstance(part, dict) or not (part.get("type") == "image_url" or "image_url" in part):
        return None
    url = part.get("image_url") or {}
    return str(url.get("url", "") if isinstance(url, dict) else url)


def _image_part(part: Any) -> Any:
    url = image_part_url(part)
    return part if url is None else {"type": "image", "url": url}


def _token_text(token: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken object with `content`."""
    if isinstance(token, str):
        return token
    if isinstance(token, dict) and isinstance(token.get("content"), str):
        return token["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class ChatTemplates:
    """The model's chat template(s) and special tokens; `render` gives the prompt text of a chat request."""

    def __init__(self, sources: dict[str, str], bos_token: str | None = None, eos_token: str | None = None) -> None:
        # sources: name → Jinja source; "default" is used, "tool_use" (when present) for requests with tools
        self.bos_token, self.eos_token = bos_token, eos_token
        self.sources = dict(sources)
        self._compiled: dict[str, jinja2.Template | TemplateError] = {}
        env = _environment()
        self._uses_tools: set[str] = set()  # templates that read the `tools` variable
        self._reads_parts = {name for name, source in self.sources.items() if _READS_PARTS.search(source)}
        for name, source in self.sources.items():
            try:
                if "tools" in jinja2.meta.find_undeclared_variables(env.parse(source)):
                    self._uses_tools.add(name)
            except jinja2.TemplateSyntaxError:
                pass  # reported below, at every request
            for pattern, replacement in _REWRITES:
                source = pattern.sub(replacement, source)
            try:
                self._compiled[name] = env.from_string(source)
            except jinja2.TemplateSyntaxError as e:
                # TGI would not start; we serve, and every chat request gets the syntax error instead
                self._compiled[name] = TemplateError(_detail(e))

    @classmethod
    def load(cls, model_path: str | Path, override: str = "") -> ChatTemplates:
        """The template, first found wins: the --chat-template override, chat_template.jinja, chat_template.json,
        tokenizer_config.json `chat_template` (a string, or a list of {name, template})."""
        folder = Path(model_path)
        config = _read_json(folder / "tokenizer_config.json")
        special = _read_json(folder / "special_tokens_map.json")  # older folders keep bos/eos only there
        bos = _token_text(config.get("bos_token")) or _token_text(special.get("bos_token"))
        eos = _token_text(config.get("eos_token")) or _token_text(special.get("eos_token"))
        jinja_file = folder / "chat_template.jinja"
        if override:
            value: Any = override
        elif jinja_file.is_file():
            value = jinja_file.read_text(encoding="utf-8")
        elif "chat_template" in (json_file := _read_json(folder / "chat_template.json")):
            value = json_file["chat_template"]
        else:
            value = config.get("chat_template")
        return cls(_sources(value), bos, eos)

    def with_tool_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], tool_prompt: str | None
    ) -> list[dict[str, Any]]:
        """TGI's prompt injection for a request with tools: "\n---\n", the tools as JSON when the template does not
        render them itself, and the tool prompt, appended to the last message's content."""
        if not messages:
            return messages
        name = "tool_use" if "tool_use" in self._compiled else "default"
        text = "\n---\n"
        if name not in self._uses_tools:
            text += json.dumps(tools, separators=(",", ":"), ensure_ascii=False) + "\n"
        text += tool_prompt or DEFAULT_TOOL_PROMPT
        last = dict(messages[-1])
        last["content"] = flatten_content(last) + text
        last.pop("tool_calls", None)
        return [*messages[:-1], last]

    def source(self, tools: bool = True) -> str:
        """The template's text (the tool-use one where there is one): what the tool and reasoning parsers read."""
        return self.sources.get("tool_use" if tools and "tool_use" in self.sources else "default", "")

    def uses_tools(self) -> bool:
        """Whether the template (the tool-use one where there is one) renders the `tools` it is given."""
        return ("tool_use" if "tool_use" in self.sources else "default") in self._uses_tools

    def reads_parts(self, tools: list[dict[str, Any]] | None = None) -> bool:
        """Whether the template a request uses loops over content parts (a multimodal template)."""
        return ("tool_use" if tools and "tool_use" in self._compiled else "default") in self._reads_parts

    def probe(self, kwargs: dict[str, Any] | None = None) -> str:
        """A one-message chat rendered with its generation prompt ("" when the template fails on it)."""
        try:
            return self.render([{"role": "user", "content": "."}], None, kwargs, native=True)
        except TemplateError:
            return ""

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        kwargs: dict[str, Any] | None = None,
        documents: list[dict[str, Any]] | None = None,
        native: bool = False,
    ) -> str:
        """The prompt text; raises TemplateError (TGI's message) when there is no template or rendering fails.
        `native`: the model's own way (module docstring), else TGI's flattening."""
        name = "tool_use" if tools and "tool_use" in self._compiled else "default"
        template = self._compiled.get(name)
        if template is None:
            raise NOT_FOUND
        if isinstance(template, TemplateError):
            raise template
        if native:
            chat = native_messages(messages, name in self._reads_parts)
            tools = _no_nulls(tools) if tools else tools
        else:
            chat = [{"role": m.get("role"), "content": flatten_content(m)} for m in messages]
        # TGI's continue_final_message: a final assistant message is continued, not closed, so no generation prompt
        continuing = bool(chat) and chat[-1]["role"] == "assistant" and isinstance(chat[-1].get("content"), str)
        if continuing:
            chat[-1]["content"] += _CONTINUE_TAG
        variables: dict[str, Any] = dict(kwargs or {})  # the fixed variables below win over chat_template_kwargs
        for key, value in (("bos_token", self.bos_token), ("eos_token", self.eos_token)):
            if value is not None:  # unset stays undefined (renders empty) rather than "None"
                variables[key] = value
        if documents is not None:
            variables["documents"] = documents
        variables.update(messages=chat, tools=tools, add_generation_prompt=not continuing)
        try:
            text = template.render(**variables)
        except Exception as e:  # any render failure is the client's template_error, never a crash
            raise TemplateError(_detail(e)) from e
        if continuing:
            text = _continue(text)
        return text


def _continue(text: str) -> str:
    """Cut the rendered chat right after the final message's content; TGI trims trailing whitespace there.

    TGI finds the content with rfind, which can hit a later copy (e.g. content "assistant" in a generation
    prompt); the tag, as transformers uses it, cannot. A template that dropped the content leaves the text as is
    (TGI's fallback when rfind finds nothing).
    """
    loc = text.rfind(_CONTINUE_TAG.strip())
    if loc < 0:
        return text
    return text[:loc].rstrip()


def _sources(value: Any) -> dict[str, str]:
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):  # [{name, template}] (tokenizer_config.json's list form)
        return {
            t["name"]: t["template"]
            for t in value
            if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
        }
    return {}
