"""A request's `priority` in the tokenizer: refused with vLLM's text unless the scheduler orders by it, else carried
to the scheduler in SamplingParams (across the bus)."""

from __future__ import annotations

import dataclasses

from libs.protocol import codec
from libs.protocol.messages import RequestError, TokenizedRequest
from services.tokenizer.processor import Processor

from .conftest import request


def test_priority_is_refused_under_fcfs(processor):
    out = processor.process(request("hello", max_new_tokens=2, priority=-3))
    assert isinstance(out, RequestError) and out.error_type == "validation"
    assert out.message == "Input validation error: Got priority -3 but Priority scheduling is not enabled."
    out = processor.process(request("hello", max_new_tokens=2, priority=0))  # the default is always fine
    assert isinstance(out, TokenizedRequest) and out.sampling.priority == 0


def test_priority_travels_under_the_priority_policy(settings):
    processor = Processor.from_settings(dataclasses.replace(settings, scheduling_policy="priority"))
    for kw in ({}, {"do_sample": True, "temperature": 0.5}):  # greedy and sampled resolve alike
        out = processor.process(request("hello", max_new_tokens=2, priority=-3, **kw))
        assert isinstance(out, TokenizedRequest)
        assert codec.decode(codec.encode(out)).sampling.priority == -3
