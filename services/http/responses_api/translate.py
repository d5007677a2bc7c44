"""A Responses request → the OpenAI chat body of the internal chat path (services.http.chat_path), and a
response's output items → the chat messages that continue a conversation (previous_response_id).

instructions become the first system message; input items become messages in order: a message item as is
(`developer` read as `system`, input_text / output_text parts as text, input_image as an image part), the
function_call items that follow one another as one assistant message with `tool_calls` (the assistant message
they follow, when they follow one: a replayed turn of text and calls is one turn, as in chat), a function_call_output
as a `tool` message answering its call_id; a reasoning item's text (its reasoning_text parts, else its summary)
becomes the `reasoning_content` of the assistant message that follows it (the template decides whether that turn
shows it; with no assistant message after it, it is left out). Flat function tools become chat tools,
`{type: function, name}` the chat's named choice, and `text.format` the chat's response_format.
"""

from __future__ import annotations

import json
from typing import Any

from services.http.errors import OpenAIFailure
from services.http.responses_api.schemas import (
    FunctionCall,
    OutputItem,
    ReasoningItem,
    ResponseOutputMessage,
    ResponsesRequest,
)

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def invalid(message: str, param: str | None = None) -> OpenAIFailure:
    """A request the Responses API refuses: 400, OpenAI's invalid_request_error."""
    return OpenAIFailure(message, 400, kind="invalid_request_error", code="invalid_request", param=param)


def _content(content: Any, where: str) -> str | list[dict]:
    """A message item's content → the chat's: a text, or text and image parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of content parts", where)
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise invalid(f"Unsupported content part at {where}.content[{i}]: {kind!r}", f"{where}.content")
    if all(p["type"] == "text" for p in parts):  # plain text: one string, as every template reads it
        return "".join(p["text"] for p in parts)
    return parts


def input_messages(items: str | list[dict[str, Any]]) -> list[dict]:
    """`input` → chat messages (see the module's note); raises Failure for an item it cannot take."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    names: dict[str, str] = {}  # call_id → function name, for the tool messages
    reasoning: list[str] = []  # reasoning items' texts, for the next assistant message
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = ROLES.get(item.get("role"))
            if role is None:
                raise invalid(f"{where}.role must be one of user, assistant, system, developer", f"{where}.role")
            messages.append({"role": role, "content": _content(item.get("content"), where)})
            if role == "assistant":
                _reason(messages[-1], reasoning)
            else:
                reasoning.clear()  # reasoning before a user turn belongs to no assistant turn
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(v, str) for v in (call_id, name, arguments)):
                raise invalid(f"{where}: a function_call needs call_id, name and arguments (strings)", where)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the turn's text, or its earlier calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            _reason(messages[-1], reasoning)
            names[call_id] = name
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise invalid(f"{where}: a function_call_output needs a call_id", f"{where}.call_id")
            text = output if isinstance(output, str) else _content(output, where) if isinstance(output, list) else None
            if not isinstance(text, str):
                raise invalid(f"{where}.output must be a string or text parts", f"{where}.output")
            message = {"role": "tool", "tool_call_id": call_id, "content": text}
            if call_id in names:
                message["name"] = names[call_id]
            messages.append(message)
        elif kind == "reasoning":
            reasoning.append(_reasoning_text(item, where))
        else:
            raise invalid(f"Unsupported input item type at {where}: {kind!r}", f"{where}.type")
    return messages


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text: its reasoning_text parts, else its summary_text parts ("" for only
    encrypted_content, which nothing here can read)."""
    for key in ("content", "summary"):
        parts = item.get(key) or []
        if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
            raise invalid(f"{where}.{key} must be a list of text parts", f"{where}.{key}")
        texts = [p["text"] for p in parts if isinstance(p.get("text"), str)]
        if texts:
            return "\n".join(texts)
    return ""


def _reason(message: dict, reasoning: list[str]) -> None:
    """The reasoning items seen since the last turn → `message`'s reasoning_content (added to any it has)."""
    text = "\n".join(t for t in reasoning if t)
    reasoning.clear()
    if text:
        previous = message.get("reasoning_content")
        message["reasoning_content"] = f"{previous}\n{text}" if previous else text


def output_messages(output: list[OutputItem]) -> list[dict]:
    """A response's output → the assistant turn that the next request's prompt holds."""
    items: list[dict] = []
    for item in output:
        if isinstance(item, ReasoningItem):
            parts = [{"type": "reasoning_text", "text": p.text} for p in item.content]
            items.append({"type": "reasoning", "content": parts})
        elif isinstance(item, ResponseOutputMessage):
            text = "".join(p.text for p in item.content)
            items.append({"type": "message", "role": "assistant", "content": text})
        elif isinstance(item, FunctionCall):
            items.append(
                {"type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": item.arguments}
            )
    return input_messages(items) if items else []


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict] | None:
    """Flat function tools → chat tools; another tool type (web_search, file_search, …) is refused."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise invalid(f"Unsupported tool type at tools[{i}]: {kind!r} (only function tools)", f"tools[{i}].type")
        if not isinstance(tool.get("name"), str):
            raise invalid(f"tools[{i}].name must be a string", f"tools[{i}].name")
        function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if choice is None or isinstance(choice, str):
        if choice not in (None, "auto", "none", "required"):
            raise invalid(f"tool_choice must be auto, none, required or a function, not {choice!r}", "tool_choice")
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid(f"Unsupported tool_choice: {json.dumps(choice)}", "tool_choice")


def response_format(body: ResponsesRequest) -> dict | None:
    """text.format → the chat's response_format."""
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise invalid("text.format.schema must be a JSON schema object", "text.format.schema")
        schema = {"name": fmt.get("name") or "response", "schema": fmt["schema"], "strict": fmt.get("strict")}
        return {"type": "json_schema", "json_schema": schema}
    raise invalid(f"Unsupported text.format type: {fmt.get('type')!r}", "text.format.type")


def chat_body(body: ResponsesRequest, history: list[dict]) -> dict[str, Any]:
    """The chat body of `body`, after the `history` of its previous responses (already chat messages)."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages += history + input_messages(body.input)
    if not messages:
        raise invalid("input must hold at least one item", "input")
    chat: dict[str, Any] = {
        "messages": messages,
        "model": body.model,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "seed": body.seed,
        "stream": body.stream,
        "tools": chat_tools(body.tools),
        "tool_choice": chat_tool_choice(body.tool_choice),
        "tool_prompt": body.tool_prompt,
        "response_format": response_format(body),
        "parallel_tool_calls": body.parallel_tool_calls,
        # reasoning.effort → the chat's reasoning_effort, whose budget ends the reasoning (README)
        "reasoning_effort": body.reasoning.effort if body.reasoning is not None else None,
    }
    return {k: v for k, v in chat.items() if v is not None}
