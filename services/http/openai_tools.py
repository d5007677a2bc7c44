"""TGI's tools for OpenAI chat: the grammar that forces a tool call (ToolGrammar::apply) and the reading of the
call back out of the generated JSON.

The tool structs themselves, those of the request and of the answer, are in services.http.openai_schemas.
"""

from __future__ import annotations

import orjson

from services.http.errors import Failure
from services.http.openai_schemas import ChatRequest, ToolCall, ToolCallFunction, ToolChoiceObject

NO_TOOL = {
    "type": "function",
    "function": {
        "name": "no_tool",
        "description": "Open ended response with no specific tool selected",
        "arguments": {"type": "object"},
    },
}


def tool_error(message: str) -> Failure:
    return Failure(f"Tool error: {message}", "tool_error")


def tool_grammar(body: ChatRequest) -> tuple[list[dict] | None, dict | None]:
    """TGI's ToolGrammar::apply: the tools the template sees and the JSON-schema grammar that forces a call."""
    if body.tools is not None and body.response_format is not None:
        raise tool_error("Grammar and tools are mutually exclusive")
    if not body.tools:
        return None, None
    choice = body.tool_choice
    if isinstance(choice, ToolChoiceObject):
        choice = choice.function.name
    if choice == "none":
        return None, None
    if choice in (None, "auto"):
        tools = [*body.tools, NO_TOOL]
    elif choice == "required":
        tools = list(body.tools)
    else:
        tools = [t for t in body.tools if t["function"]["name"] == choice]
        if not tools:
            raise tool_error(f"Tool with name {choice} not found")
    functions = {}
    for tool in tools:
        fn = tool["function"]
        params = fn.get("arguments") or fn.get("parameters") or {}
        properties = {"_name": {"type": "string", "const": fn["name"]}, **(params.get("properties") or {})}
        functions[fn["name"]] = {
            "description": fn.get("description"),
            "properties": properties,
            "required": ["_name", *(params.get("required") or [])],
            "additionalProperties": params.get("additionalProperties", False),
        }
    schema = {
        "$functions": functions,
        "properties": {"function": {"anyOf": [{"$ref": f"#/$functions/{name}"} for name in functions]}},
    }
    return tools, {"type": "json", "value": schema}


def parse_tool_call(generated_text: str) -> list[ToolCall] | None:
    """TGI's non-stream tool output: {"function": {"_name": …, …}} → tool_calls; None for `no_tool`'s content."""
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
    arguments = {k: v for k, v in function.items() if k != "_name"}
    if name == "no_tool":
        return None
    arguments_text = orjson.dumps(arguments).decode()
    return [ToolCall(id="0", type="function", function=ToolCallFunction(None, name, arguments_text))]


def no_tool_content(generated_text: str) -> str:
    """The `content` of a `no_tool` answer (TGI re-runs without tools; we answer with what it wrote)."""
    function = orjson.loads(generated_text)["function"]
    content = function.get("content")
    if not isinstance(content, str):
        raise tool_error("No `content` found in generated text")
    return content
