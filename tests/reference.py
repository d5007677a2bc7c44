"""The ground truth for greedy output: transformers' own `generate()`, one prompt at a time, eager, float32."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=16)
def load_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def reference_generate(model_dir, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy new tokens for `prompt_ids` alone (batch 1); stops on the model's EOS ids as generate() does."""
    model = load_model(str(model_dir))
    input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, input_ids.shape[1] :].tolist()
