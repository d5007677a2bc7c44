"""The benchmark's models: built locally (no Hub), cached under ~/.cache/switchyard/bench-models/.

- `smollm2`: LlamaForCausalLM with SmolLM2-135M's config (hidden 576, 30 layers, 9 / 3 KV heads, vocab 49152),
  random weights, and a byte-level BPE tokenizer of that size trained on Python's standard library (the only
  sizeable text on an offline machine), so every id the model can emit decodes to real text;
- `tiny`: the same tokenizer under a 2-layer, 64-wide Llama, for the pipeline's hops rather than the model;
- `llama-128k`: a small-bodied Llama (hidden 512, 4 layers, heads of 64) with Llama 3's 128,256-id vocabulary, so
  the LM head, sampling and per-step overhead decide its speed; its tokenizer is trained the same way on more text
  (the standard library and the installed packages' sources, once);
- `gemma`: the embedded Gemma-3-270M, resolved by the model store.
Each is served through a "no-EOS" view (`no_eos_view`), so every request runs to `max_new_tokens` on every engine.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path

from libs.runtime.settings import env_value

CACHE = Path(env_value("bench_cache") or Path.home() / ".cache/switchyard/bench-models")
VOCAB = 49152
SMOLLM2 = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,  # head_dim 32: vLLM's CPU attention has no kernel for head_dim 16
    num_key_value_heads=2,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
LLAMA_128K = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,  # head_dim 64
    num_key_value_heads=2,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
SHAPES = {"smollm2": SMOLLM2, "tiny": TINY, "llama-128k": LLAMA_128K}
BOS, EOS = "<|bos|>", "<|eos|>"
# (ids, bytes of text to train on, whether the installed packages' sources join the standard library's) for each
# tokenizer: enough text for that many merges, trained once
TOKENIZERS = {VOCAB: (24_000_000, False), 128_256: (80_000_000, True)}
VOCABS = {"llama-128k": 128_256}


def corpus(train_bytes: int, packages: bool):
    """Python sources (the standard library's, then the installed packages'), in a fixed order: deterministic
    across runs on one machine."""
    paths = sysconfig.get_paths()
    roots = [Path(paths["stdlib"])] + ([Path(paths["purelib"])] if packages else [])
    seen = 0
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if root == roots[0] and "site-packages" in path.parts:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            seen += len(text)
            yield text
            if seen >= train_bytes:
                return


def build_tokenizer(out: Path, vocab: int = VOCAB) -> Path:
    """A byte-level BPE tokenizer with exactly `vocab` ids (BOS prepended), written for AutoTokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    out.mkdir(parents=True, exist_ok=True)
    if (out / "tokenizer.json").exists():
        return out
    train_bytes, packages = TOKENIZERS[vocab]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|pad|>", BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(train_bytes, packages), trainer=trainer)
    if tok.get_vocab_size() != vocab:
        raise RuntimeError(f"the BPE reached only {tok.get_vocab_size()} of {vocab} ids: too little text")
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 1)])
    tmp = out / "tokenizer.json.tmp"
    tok.save(str(tmp))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": "<|pad|>",
        "add_bos_token": True,
        "model_max_length": 8192,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(out / "tokenizer.json")
    return out


def build_llama(name: str) -> Path:
    """Build (once) the random-weight Llama `name` (a key of SHAPES) with the benchmark tokenizer."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = CACHE / name
    if (out / "model.safetensors").exists():
        return out
    vocab = VOCABS.get(name, VOCAB)
    tok_dir = build_tokenizer(CACHE / ("tokenizer" if vocab == VOCAB else f"tokenizer-{vocab}"), vocab)
    out.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((tok_dir / f).read_bytes())
    config = LlamaConfig(vocab_size=vocab, pad_token_id=0, bos_token_id=1, eos_token_id=2, **SHAPES[name])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)  # transformers' own init (std 0.02): realistic magnitudes
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(out, safe_serialization=True)
    return out


def no_eos_view(folder: Path) -> Path:
    """A folder of symlinks to `folder` whose config and generation_config name no EOS token.

    Benchmarks need every request to run to `max_new_tokens` on every engine (ours, transformers, vLLM);
    a random or real model may emit EOS at any step, which would make token counts differ between runs.
    """
    folder = Path(folder).resolve()
    view = CACHE / "views" / f"{folder.name}-{hashlib.sha1(str(folder).encode()).hexdigest()[:8]}"
    view.mkdir(parents=True, exist_ok=True)
    for item in folder.iterdir():
        if item.name in ("config.json", "generation_config.json"):
            continue
        link = view / item.name
        if not link.exists():
            link.symlink_to(item)
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = None
    if "text_config" in config:
        config["text_config"]["eos_token_id"] = None
    (view / "config.json").write_text(json.dumps(config, indent=2))
    gen = {}
    if (folder / "generation_config.json").exists():
        gen = json.loads((folder / "generation_config.json").read_text())
    gen["eos_token_id"] = []
    (view / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return view


def resolve(model: str) -> tuple[str, Path]:
    """(label, no-EOS folder) for `smollm2`, `tiny`, `llama-128k`, `gemma`, or a local folder."""
    if model in SHAPES:
        return model, no_eos_view(build_llama(model))
    if model == "gemma":
        from libs.runtime import model_store

        return "gemma-3-270m", no_eos_view(model_store.resolve_model("gemma-3-270m"))
    return Path(model).name, no_eos_view(Path(model))
