"""A Messages request → the OpenAI chat body of the internal chat path (services.http.chat_path).

`system` becomes the first system message. A user turn's tool_result blocks become `tool` messages answering
their tool_use ids (first, in order), its text and image blocks one user message after them; an assistant turn's
text blocks its content, its tool_use blocks its `tool_calls` (the input as JSON arguments) and its thinking
blocks its `reasoning_content` (the template decides whether that turn shows it; a redacted_thinking block, which
nothing here can read, is left out). Tools with `input_schema` become chat tools;
tool_choice auto / any / tool / none the chat's auto / required / named / none; `thinking` the template's
`enable_thinking`; `output_config.effort` the chat's `reasoning_effort` (EFFORTS); `output_config.format` (structured
outputs, a JSON schema) the chat's `response_format`, which the tokenizer compiles into the answer's grammar.
"""

from __future__ import annotations

import json
from typing import Any

from services.http.anthropic.schemas import CountTokensRequest, MessagesRequest
from services.http.errors import Failure

CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def invalid(message: str) -> Failure:
    """A request the Messages API refuses: 400, Anthropic's invalid_request_error (routes.error_response)."""
    return Failure(message, "invalid_request_error", 400)


def _text(content: Any, where: str) -> str:
    """A text, or a list of text blocks, as one text (system, tool_result content)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in content):
        return "".join(str(b.get("text", "")) for b in content)
    raise invalid(f"{where}: expected a string or a list of text blocks")


def _image(block: dict, where: str) -> dict:
    source = block.get("source") or {}
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        url = f"data:{source.get('media_type', 'image/png')};base64,{source['data']}"
        return {"type": "image_url", "image_url": {"url": url}}
    raise invalid(f"{where}.source: an image needs a url or base64 source")


def _user(blocks: list, where: str, names: dict[str, str]) -> list[dict]:
    tools_out, parts = [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append(_image(block, at))
        elif kind == "tool_result" and isinstance(block.get("tool_use_id"), str):
            content = _text(block.get("content", ""), f"{at}.content")
            message = {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}
            if block["tool_use_id"] in names:
                message["name"] = names[block["tool_use_id"]]
            tools_out.append(message)
        else:
            raise invalid(f"{at}: unsupported content block {kind!r} in a user message")
    if not parts:
        return tools_out
    if all(p["type"] == "text" for p in parts):
        return [*tools_out, {"role": "user", "content": "".join(p["text"] for p in parts)}]
    return [*tools_out, {"role": "user", "content": parts}]


def _assistant(blocks: list, where: str, names: dict[str, str]) -> dict:
    text, calls, thinking = [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise invalid(f"{at}: a tool_use block needs an id and a name")
            if not isinstance(block.get("input", {}), dict):
                raise invalid(f"{at}.input: must be an object")
            arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
            calls.append(
                {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}
            )
            names[block["id"]] = block["name"]
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise invalid(f"{at}.thinking: must be a string")
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue
        else:
            raise invalid(f"{at}: unsupported content block {kind!r} in an assistant message")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if any(thinking):
        message["reasoning_content"] = "\n".join(t for t in thinking if t)
    return message


def chat_messages(body: CountTokensRequest) -> list[dict]:
    messages = []
    if body.system is not None:
        system = _text(body.system, "system")
        if system:
            messages.append({"role": "system", "content": system})
    if not body.messages:
        raise invalid("messages: at least one message is required")
    names: dict[str, str] = {}  # tool_use id → tool name, for the tool messages
    for i, m in enumerate(body.messages):
        where = f"messages.{i}"
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise invalid(f"{where}.role: Input should be 'user' or 'assistant'")
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
        elif isinstance(content, list):
            messages += _user(content, where, names) if role == "user" else [_assistant(content, where, names)]
        else:
            raise invalid(f"{where}.content: expected a string or a list of content blocks")
    return messages


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise invalid(f"tools.{i}.name: Field required")
        if tool.get("type") not in (None, "custom"):
            raise invalid(
                f"tools.{i}: unsupported tool type {tool.get('type')!r} (only client tools with input_schema)"
            )
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise invalid(f"tools.{i}.input_schema: Field required")
        function = {"name": tool["name"], "parameters": schema}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: dict | None) -> str | dict | None:
    if choice is None:
        return None
    kind = choice.get("type")
    if kind in CHOICES:
        return CHOICES[kind]
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid(f"tool_choice: expected type auto, any, tool (with a name) or none, not {kind!r}")


def _thinking(thinking: dict | None) -> dict | None:
    if thinking is None:
        return None
    if thinking.get("type") not in ("enabled", "disabled", "adaptive"):
        raise invalid("thinking.type: expected enabled, disabled or adaptive")
    return {"enable_thinking": thinking["type"] != "disabled"}


# Anthropic's efforts → the chat's reasoning_effort (the template's variable and a thinking budget); the two above
# `high` are `high`, the top of OpenAI's scale and of gpt-oss's template
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


def _effort(config: dict | None) -> str | None:
    effort = (config or {}).get("effort")
    if effort is None:
        return None
    if effort not in EFFORTS:
        raise invalid(f"output_config.effort: expected one of {', '.join(EFFORTS)}")
    return EFFORTS[effort]


def _format(config: dict | None) -> dict | None:
    """output_config.format (`{type: json_schema, schema}`) → the chat's response_format; the schema itself is
    checked where the chat's is, by the tokenizer's grammar compiler (a bad one: a 422)."""
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise invalid(f"output_config.format.type: expected json_schema, not {kind!r}")
    if not isinstance(fmt.get("schema"), dict):
        raise invalid("output_config.format.schema: must be a JSON schema object")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def chat_body(body: CountTokensRequest) -> dict[str, Any]:
    """The chat body of `body` (a count_tokens body: the prompt's parts only)."""
    chat: dict[str, Any] = {
        "messages": chat_messages(body),
        "model": body.model,
        "tools": chat_tools(body.tools),
        "tool_choice": chat_tool_choice(body.tool_choice),
        "tool_prompt": body.tool_prompt,
        "chat_template_kwargs": _thinking(body.thinking),
        "reasoning_effort": _effort(body.output_config),
        "response_format": _format(body.output_config),
    }
    budget = (body.thinking or {}).get("budget_tokens") if (body.thinking or {}).get("type") == "enabled" else None
    if budget is not None:
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise invalid("thinking.budget_tokens: must be a positive integer")
        chat["thinking_token_budget"] = budget
    if body.tool_choice is not None and body.tool_choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False
    if isinstance(body, MessagesRequest):
        chat.update(
            max_tokens=body.max_tokens,
            stop=body.stop_sequences,
            stream=body.stream,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
        )
    return {k: v for k, v in chat.items() if v is not None}
