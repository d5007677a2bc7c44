"""Chat templates, as TGI applies them (router/src/infer/chat_template.rs), rendered with jinja2's sandbox.

TGI renders with minijinja; we render with jinja2's ImmutableSandboxedEnvironment set up as `transformers` does
(trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that does not escape
HTML), since the Hub's templates are written for that. TGI's input shaping is kept: message content is flattened
to one string (text parts joined, images as `![](url)`, tool calls as JSON), only role and content reach the
template, and a final assistant message is continued rather than closed.
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

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text; raises TemplateError (TGI's message) when there is no template or rendering fails."""
        name = "tool_use" if tools and "tool_use" in self._compiled else "default"
        template = self._compiled.get(name)
        if template is None:
            raise NOT_FOUND
        if isinstance(template, TemplateError):
            raise template
        chat = [{"role": m.get("role"), "content": flatten_content(m)} for m in messages]
        # TGI's continue_final_message: a final assistant message is continued, not closed, so no generation prompt
        continuing = bool(chat) and chat[-1]["role"] == "assistant"
        if continuing:
            chat[-1]["content"] += _CONTINUE_TAG
        variables: dict[str, Any] = dict(kwargs or {})  # the fixed variables below win over chat_template_kwargs
        for key, value in (("bos_token", self.bos_token), ("eos_token", self.eos_token)):
            if value is not None:  # unset stays undefined (renders empty) rather than "None"
                variables[key] = value
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
