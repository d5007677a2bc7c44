"""`--lora-adapters` / `LORA_ADAPTERS`: TGI's comma list of adapters, parsed and resolved to local folders.

Each entry is one of
  `org/name`            a Hub adapter at its default revision; served under the name `org/name`
  `org/name@revision`   the same at a branch, tag or commit
  `name=/local/path`    a folder written by peft's `save_pretrained`, served under `name`

TGI's grammar (`^([^=@]+)(?:=([^@]+))?(?:@(.+))?$`) and its "Invalid LoRA adapter format: <entry>"; stricter, a
revision on a local path and a name given twice are errors too. Hub ids resolve through `snapshot_download` at
call time (HF_TOKEN, HF_HUB_CACHE, HF_HUB_OFFLINE), fetching only the adapter's two files. Errors are
`LoraFlagError`, printed by the launcher before it exits 1. docs/lora.md tells more.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

ENV_VAR = "LORA_ADAPTERS"
ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"]
_ENTRY = re.compile(r"^([^=@]+)(?:=([^@]+))?(?:@(.+))?$")
# names a request may use for the base model (OpenAI's `model` field): an adapter cannot take them
RESERVED_NAMES = ("tgi",)


class LoraFlagError(ValueError):
    """A `--lora-adapters` entry that cannot be used; the message is meant for the user as is."""


@dataclass(frozen=True)
class AdapterSpec:
    name: str  # what requests put in `adapter_id` / `model`
    source: str  # a Hub repo id, or a local path
    revision: str | None = None
    local: bool = False


def parse_lora_adapters(value: str | None) -> list[AdapterSpec]:
    """The entries of a `--lora-adapters` value, in order; an empty or missing value is no adapter."""
    if value is None or not value.strip():
        return []
    specs: list[AdapterSpec] = []
    seen: set[str] = set()
    for raw in value.split(","):
        entry = raw.strip()
        match = _ENTRY.match(entry)
        if entry.count("=") > 1 or entry.count("@") > 1 or match is None:
            raise LoraFlagError(f"Invalid LoRA adapter format: {entry}")
        name, path, revision = (g.strip() if g is not None else None for g in match.groups())
        if not name or path == "" or revision == "":
            raise LoraFlagError(f"Invalid LoRA adapter format: {entry}")
        if path is not None and revision is not None:
            raise LoraFlagError(f"LoRA adapter {name!r}: a revision (@{revision}) applies to Hub ids, not to a path")
        if name in seen:
            raise LoraFlagError(f"LoRA adapter name {name!r} is given twice")
        if name in RESERVED_NAMES:
            raise LoraFlagError(f"LoRA adapter name {name!r} is reserved for the base model")
        seen.add(name)
        if path is not None:
            specs.append(AdapterSpec(name=name, source=path, local=True))
        else:
            specs.append(AdapterSpec(name=name, source=name, revision=revision))
    return specs


def from_flag_or_env(flag: str | None, environ: dict[str, str] | None = None) -> list[AdapterSpec]:
    """The flag wins over `LORA_ADAPTERS` (as clap's `env =` does in TGI's launcher)."""
    env = os.environ if environ is None else environ
    return parse_lora_adapters(flag if flag is not None else env.get(ENV_VAR))


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def resolve(spec: AdapterSpec, *, token: str | None = None, cache_dir: str | None = None) -> Path:
    """The local folder holding `spec`'s adapter files (downloading a Hub adapter into the cache if needed)."""
    if spec.local:
        folder = Path(spec.source).expanduser()
        if not folder.is_dir():
            raise LoraFlagError(f"LoRA adapter {spec.name!r}: folder {spec.source} does not exist")
        return folder.resolve()
    from huggingface_hub import constants, snapshot_download

    token = token or os.environ.get("HF_TOKEN") or None
    cache_dir = cache_dir or os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or None
    # huggingface_hub reads HF_HUB_OFFLINE once, at import: reading it here honours a later change too
    offline = _env_true("HF_HUB_OFFLINE") or constants.is_offline_mode()
    try:
        folder = snapshot_download(
            spec.source,
            revision=spec.revision,
            token=token,
            cache_dir=cache_dir,
            allow_patterns=ADAPTER_FILES,
            local_files_only=offline,
        )
    except Exception as exc:  # not found, gated, offline, bad id, network: one clear error, token scrubbed
        where = f"the local cache {cache_dir or constants.HF_HUB_CACHE} (offline mode)" if offline else "the Hub"
        detail = f"{type(exc).__name__}: {exc}"
        if token:
            detail = detail.replace(token, "***")
        raise LoraFlagError(
            f"LoRA adapter {spec.name!r} (revision {spec.revision or 'main'!r}) is not available from {where}: {detail}"
        ) from None
    return Path(folder)


def resolve_all(specs: list[AdapterSpec], **kwargs) -> dict[str, Path]:
    """name → folder for every spec, in order; the first failure stops (the launcher exits on it)."""
    return {spec.name: resolve(spec, **kwargs) for spec in specs}
