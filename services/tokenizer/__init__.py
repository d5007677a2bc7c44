"""The tokenizer service: TGI's validation rules and messages, chat templates, tokenization, truncation.

Stateless per request: it validates and tokenizes a `GenerateRequest`, then forwards a `TokenizedRequest`
to the router's admit address, or publishes a `RequestError` to `out.<ingress>`.
"""
