"""The detokenizer service: incremental UTF-8-safe detokenization, stop sequences, token texts, final text.

It turns the scheduler's token batches into per-ingress text batches and reports stop-sequence hits
back to the scheduler that runs the request.
"""
