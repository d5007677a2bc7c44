"""`adapter_id`: a loaded LoRA adapter travels with the request; an unknown one is a 422, never the base model."""

from libs.protocol.messages import TokenizedRequest
from services.tokenizer.processor import Processor
from tests.services.tokenizer.test_rules import expect_error, run


def test_adapter_id_is_checked_against_the_loaded_adapters(settings):
    processor = Processor.from_settings(
        settings.replace(model_id="org/base", lora_adapters="a=/x/a,org/b=/x/b", max_loras=2)
    )
    for given, expected in [("a", "a"), ("org/b", "org/b"), (None, None), ("", None), ("org/base", None)]:
        result = run(processor, adapter_id=given)
        assert isinstance(result, TokenizedRequest), result
        assert result.adapter == expected, given
    message = "`adapter_id` `c` is not a loaded LoRA adapter (loaded: `a`, `org/b`)"
    expect_error(run(processor, adapter_id="c"), message)


def test_no_adapters_loaded(processor):
    expect_error(run(processor, adapter_id="x"), "`adapter_id` `x` is not a loaded LoRA adapter (loaded: none)")
