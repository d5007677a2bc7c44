"""OpenAI's API as TGI serves it: routes, request bodies, response structs, tool calls."""
