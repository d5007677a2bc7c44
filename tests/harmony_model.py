"""A tiny gpt-oss-shaped model: the tiny test tokenizer with gpt-oss's harmony special tokens added, a tiny random
llama body over that vocabulary, gpt-oss's own chat template, and `<|return|>` / `<|call|>` as its EOS tokens (as
gpt-oss's generation_config has them).

The template (tests/data/chat_templates/gpt_oss.jinja) is gpt-oss's, as llama.cpp vendors it
(models/templates/openai-gpt-oss-120b.jinja in llama-cpp-python 0.3.36's sdist), unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

from tests.tiny_models import build_model, build_tokenizer

TEMPLATE = Path(__file__).parent / "data" / "chat_templates" / "gpt_oss.jinja"
# gpt-oss's harmony markers (special tokens of its tokenizer)
MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]


def build_harmony_tokenizer(out_dir: str | Path) -> Tokenizer:
    out = Path(out_dir)
    build_tokenizer(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    missing = [m for m in MARKERS if tok.token_to_id(m) is None]
    if missing:
        tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in missing])
        tok.save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(TEMPLATE.read_text(encoding="utf-8"), encoding="utf-8")
    return tok


def build_harmony_model(out_dir: str | Path) -> Path:
    out = Path(out_dir)
    tok = build_harmony_tokenizer(out)
    build_model(out, "llama")  # its tokenizer (with the markers) is already there: the vocabulary covers them
    build_harmony_tokenizer(out)  # the template again (build_model writes the tiny ChatML one)
    ends = [tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")]
    path = out / "generation_config.json"
    config = json.loads(path.read_text())
    if config.get("eos_token_id") != ends:
        path.write_text(json.dumps({**config, "eos_token_id": ends}, indent=2))
    return out
