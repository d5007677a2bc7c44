"""Tiny, deterministic test models built locally (no Hub): a byte-level BPE tokenizer and four small causal LMs.

The models are made *sensitive*: sliding windows shorter than the test prompts, a Gemma-2 attention soft-cap
that raw scores really exceed, and weights scaled up so logits are peaked (greedy argmax is decided by clear
margins, not float noise). Everything is float32 and seeded, so two builds give identical files.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer

CORPUS = Path(__file__).parent / "data" / "corpus.txt"
VOCAB_SIZE = 1000
PAD, BOS, EOS = 0, 1, 2
SPECIALS = ["<pad>", "<bos>", "<eos>"]
SLIDING_WINDOW = 8  # shorter than most test prompts, so the window really cuts
ARCHS = ("llama", "qwen2", "gemma2", "gemma3")

# std of the random weights: large enough for peaked logits and sharp attention, small enough to stay finite
WEIGHT_STD = 0.25
EMBED_STD = 1.0
GEMMA_EMBED_STD = 0.15
GEMMA_NORM_GAIN = 2.0
GEMMA_FINAL_GAIN = 5.0

# A small ChatML-style chat template over the tiny tokenizer's specials: <bos> opens the chat, <eos> ends each
# turn (so the model's EOS ends its answer); tools, when given, go into a system turn as JSON.
CHAT_TEMPLATE = (
    "{{- bos_token -}}\n"
    "{%- if tools %}{{ '<|im_start|>system\\nTools: ' + (tools | tojson) + eos_token + '\\n' }}{% endif -%}\n"
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor -%}\n"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}\n"
)


def write_chat_template(out_dir: str | Path) -> None:
    """Write CHAT_TEMPLATE as `chat_template.jinja` (where transformers and Switchyard look first)."""
    path = Path(out_dir) / "chat_template.jinja"
    if not path.exists() or path.read_text(encoding="utf-8") != CHAT_TEMPLATE:
        path.write_text(CHAT_TEMPLATE, encoding="utf-8")


def build_tokenizer(out_dir: str | Path) -> None:
    """Train a byte-level BPE tokenizer (specials <pad>=0, <bos>=1, <eos>=2) and write it for AutoTokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_chat_template(out)
    if (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists():
        return
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: any UTF-8 text encodes
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.read_text(encoding="utf-8").splitlines(keepends=True), trainer=trainer)
    assert [tok.token_to_id(s) for s in SPECIALS] == [PAD, BOS, EOS]
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", BOS)]
    )
    tok.save(str(out / "tokenizer.json"))
    config = {
        # the generic fast tokenizer: loads tokenizer.json as is (a model-specific class could rebuild it)
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "add_bos_token": True,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _config(arch: str, vocab: int, head_dim: int = 16):
    from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        head_dim=head_dim,
        max_position_embeddings=2048,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        rms_norm_eps=1e-6,
    )
    if arch == "llama":  # MHA
        return LlamaConfig(**common, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)
    if arch == "qwen2":  # GQA 4:2 (q/k/v biases too)
        return Qwen2Config(**common, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    if arch == "gemma2":  # soft-capped attention and logits, sliding window on alternating layers
        return Gemma2Config(
            **common,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"] * 2,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=15.0,
            query_pre_attn_scalar=256,  # the real default: scale 1/16; raw scores still pass the cap
        )
    if arch == "gemma3":  # sliding + global layers, scaling by query_pre_attn_scalar (not head_dim)
        return Gemma3TextConfig(
            **common,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=8,
        )
    raise ValueError(f"unknown tiny arch {arch!r}; known: {ARCHS}")


def build_model(out_dir: str | Path, arch: str, seed: int = 0, head_dim: int = 16) -> Path:
    """Build (once) a tiny random `arch` model with the test tokenizer into `out_dir`; returns the folder. Heads of 16
    by default; kernels that need wider heads (the flash kernel: multiples of 32) get them by `head_dim`."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    if (out / "config.json").exists() and (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        write_chat_template(out)  # folders built before the template existed get it too
        return out
    build_tokenizer(out)
    vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()
    config = _config(arch, vocab, head_dim)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # Re-draw every tensor from our own seeded generator with a larger std (peaked logits, sharp attention).
        # Gemma scales embeddings by sqrt(hidden) and ties them to the LM head: with plain init the residual stream
        # is all embedding and the model just repeats its last token. A small embedding std and norm gains > 1
        # (Gemma norms compute x * (1 + w)) let attention and MLP steer the output, and a large final-norm gain
        # keeps the (tied) logits peaked.
        gemma = arch.startswith("gemma")
        for name, p in model.named_parameters():
            if "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (GEMMA_EMBED_STD if gemma else EMBED_STD))
            elif p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * WEIGHT_STD)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif gemma:  # norm weights, used as (1 + w)
                gain = GEMMA_FINAL_GAIN if name == "model.norm.weight" else GEMMA_NORM_GAIN
                p.copy_(gain - 1 + torch.randn(p.shape, generator=gen) * 0.2)
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, do_sample=False)
    model.save_pretrained(out, safe_serialization=True)
    return out


def build_all(root: str | Path) -> dict[str, Path]:
    """Every tiny arch under `root`/<arch>."""
    return {arch: build_model(Path(root) / arch, arch) for arch in ARCHS}


def prompts_for(model_dir) -> list[list[int]]:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = CORPUS.read_text(encoding="utf-8")
    spans = [(0, 5), (400, 41), (1500, 58), (2600, 17), (3700, 47)]  # (char offset, token count)
    prompts = [tok.encode(text[start:]).ids[:n] for start, n in spans]
    return prompts + [tok.encode(text[2000:2060]).ids]  # 25 tokens; the tiny llama answers it with EOS
