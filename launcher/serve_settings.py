"""TGI's launcher flags → Settings: TGI's limits derived and checked the way its launcher does, the dtype chosen
(libs/runtime/cpu.py), LoRA adapters and the quantization method resolved before any service starts."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import time
from pathlib import Path

from launcher import bus_flags, lora_flags, quantize
from libs.runtime import cpu, cpu_team, model_store
from libs.runtime.settings import Settings

log = logging.getLogger("switchyard.launcher")

# TGI flags that are accepted so a TGI command line runs unchanged, but do nothing here (yet):
# (name, type or "flag", TGI's default, what it does in TGI). A value other than the default is logged.
IGNORED = [
    ("kv-cache-dtype", str, None, "fp8 KV cache; the KV cache uses --dtype"),
    ("trust-remote-code", "flag", False, "custom model code from the Hub; only transformers' own architectures run"),
    ("max-waiting-tokens", int, 20, "how long waiting requests wait before joining; here they join every step"),
    ("waiting-served-ratio", float, 0.3, "when waiting requests force a prefill; here new prefills join every step"),
    ("disable-custom-kernels", "flag", False, "no custom kernels are used anyway"),
    ("prometheus-port", int, 9000, "a separate metrics port; metrics are served on /metrics of --port"),
    ("usage-stats", str, "on", "telemetry; none is ever sent"),
]


SPECULATE_POLICIES = ("adaptive", "always")  # --speculate-policy
SCHEDULING_POLICIES = ("fcfs", "priority")  # --scheduling-policy
SPECULATE_HELP = (
    "speculative decoding: up to N tokens drafted per decode step from n-gram matches in the request's own prompt "
    "and output (prompt lookup), verified in the same forward; outputs are unchanged, and rows whose drafts are not "
    "accepted stop drafting by themselves (env SPECULATE; default: off)"
)


def resolve_dtype(requested: str, model_path: Path) -> str:
    """The serving dtype, chosen here once (so /info can say it) by the rule in libs/runtime/cpu.py."""
    device = "cpu"
    if not cpu.torch_cpu_build():
        import torch  # only where a GPU may serve: the import costs seconds of every start

        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        choice = cpu.choose_dtype(requested, cpu.checkpoint_dtype(model_path), device)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    where = cpu.describe() if device == "cpu" else torch.cuda.get_device_name(0)
    log.info("dtype %s: %s (%s)", choice.dtype, choice.reason, where)
    return choice.dtype


def settings_from(args: argparse.Namespace, model_path: Path) -> Settings:
    """Derive TGI's limits the way its launcher does, checking they are consistent."""
    if args.max_input_tokens is not None and args.max_input_length is not None:
        raise SystemExit("error: --max-input-tokens and --max-input-length are the same flag: give one")
    info = model_store.model_info(model_path)
    max_total = args.max_total_tokens or min(4096, info.get("max_position_embeddings") or 4096)
    max_input = args.max_input_tokens or args.max_input_length or max_total - 1
    prefill = args.max_batch_prefill_tokens or max(4096, max_input)
    total = args.max_batch_total_tokens or max(65536, max_total)
    if max_input >= max_total:
        raise SystemExit(f"error: max_input_tokens ({max_input}) must be < max_total_tokens ({max_total})")
    if prefill < max_input:
        raise SystemExit(f"error: max_batch_prefill_tokens ({prefill}) must be >= max_input_tokens ({max_input})")
    if args.max_prefill_tokens_while_decoding < 0:
        raise SystemExit("error: --max-prefill-tokens-while-decoding must be >= 0 (0: no cap)")
    if args.max_prefill_ms_while_decoding < 0:
        raise SystemExit("error: --max-prefill-ms-while-decoding must be >= 0 (0: no cap)")
    if args.prefill_saturation_tokens < 0:
        raise SystemExit("error: --prefill-saturation-tokens must be >= 0 (0: fill max-batch-prefill-tokens)")
    speculate = args.speculate or 0  # TGI's default is None: no speculation
    if speculate < 0:
        raise SystemExit("error: --speculate must be >= 0")
    if not 0 <= args.image_nice <= 19:
        raise SystemExit(f"error: --image-nice must be a nice value from 0 to 19, not {args.image_nice}")
    if args.scheduling_policy not in SCHEDULING_POLICIES:  # argparse checks a flag's choices, not an env default
        raise SystemExit(f"error: --scheduling-policy must be fcfs or priority, not {args.scheduling_policy!r}")
    if args.priority_aging_seconds < 0:
        raise SystemExit("error: --priority-aging-seconds must be >= 0 (0: no aging)")
    if args.speculate_policy not in SPECULATE_POLICIES:  # argparse checks a flag's choices, not an env default
        raise SystemExit(f"error: --speculate-policy must be adaptive or always, not {args.speculate_policy!r}")
    if total < max_total:
        raise SystemExit(f"error: max_batch_total_tokens ({total}) must be >= max_total_tokens ({max_total})")
    hostname = args.hostname
    try:
        ipaddress.ip_address(hostname)
    except ValueError:  # as TGI: HOSTNAME is often a machine name (Docker sets it), not an address
        log.warning("hostname %r is not an IP address; listening on 0.0.0.0", hostname)
        hostname = "0.0.0.0"
    if args.num_shard < 1:
        raise SystemExit("error: --num-shard must be at least 1")
    if args.sharded is False and args.num_shard > 1:
        raise SystemExit("error: --sharded false is incompatible with --num-shard > 1")
    if args.sharded and args.num_shard == 1:  # TGI would count the GPUs; we need to be told
        raise SystemExit("error: --sharded true needs --num-shard > 1")
    for name in ("replicas", "tokenizer_workers", "detokenizer_workers", "http_workers"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be at least 1")
    if args.replica_base < 0:
        raise SystemExit("error: --replica-base must be at least 0")
    if args.worker_base < 0:
        raise SystemExit("error: --worker-base must be at least 0")
    if args.validation_workers < 1:
        raise SystemExit("error: `validation_workers` must be > 0")
    cuda_graphs, cuda_memory_fraction = _cuda_flags(args)
    cpu_threads, cpu_bind, cpu_reserved, cpu_busy_share = _cpu_flags(args)
    curve_secret, curve_public = bus_flags.curve_keys(args.bus_curve_secret_key, args.bus_curve_public_key)
    lora_adapters = _lora_adapters(args)
    try:
        quantization = quantize.resolve(args.quantize, model_path)
        quantize.check_shards(quantization, model_path, args.num_shard)
    except quantize.QuantizeError as e:
        raise SystemExit(f"error: {e}") from None
    for name, _, default, _ in IGNORED:
        value = getattr(args, name.replace("-", "_"))
        if value != default:
            log.warning("--%s is accepted for compatibility and ignored", name)
    try:  # the switches without a flag, as set in this process's environment, go on to every service
        switches = Settings.switches_from_env()
    except ValueError as e:
        raise SystemExit(f"error: a SWITCHYARD_* switch in the environment: {e}") from None
    return Settings(
        **switches,
        model_path=str(model_path),
        model_id=args.model_id or model_store.DEFAULT_MODEL_NAME,
        dtype=resolve_dtype(args.dtype, model_path),
        quantize=quantization or "",
        hostname=hostname,
        port=args.port,
        max_concurrent_requests=args.max_concurrent_requests,
        graceful_termination_timeout=args.graceful_termination_timeout,
        max_best_of=args.max_best_of,
        max_stop_sequences=args.max_stop_sequences,
        max_input_tokens=max_input,
        max_total_tokens=max_total,
        max_batch_prefill_tokens=prefill,
        max_prefill_tokens_while_decoding=args.max_prefill_tokens_while_decoding,
        max_prefill_ms_while_decoding=args.max_prefill_ms_while_decoding,
        prefill_saturation_tokens=args.prefill_saturation_tokens,
        max_batch_total_tokens=total,
        max_batch_size=args.max_batch_size,
        speculate=speculate,
        speculate_policy=args.speculate_policy,
        scheduling_policy=args.scheduling_policy,
        priority_aging_s=args.priority_aging_seconds,
        shard_stall_timeout=args.shard_stall_timeout,
        replicas=args.replicas,
        replica_base=args.replica_base,
        worker_base=args.worker_base,
        num_shard=args.num_shard,
        tokenizer_workers=args.tokenizer_workers,
        detokenizer_workers=args.detokenizer_workers,
        http_workers=args.http_workers,
        max_client_batch_size=args.max_client_batch_size,
        validation_workers=args.validation_workers,
        max_top_n_tokens=args.max_top_n_tokens,
        payload_limit=args.payload_limit,
        api_key=args.api_key or "",
        cors_allow_origin=_origins(args.cors_allow_origin),
        watermark_gamma=args.watermark_gamma,
        watermark_delta=args.watermark_delta,
        chat_template=_chat_template(args.chat_template),
        tool_call_parser=args.tool_call_parser or "",
        reasoning_parser=args.reasoning_parser or "",
        disable_grammar_support=args.disable_grammar_support,
        max_image_bytes=args.max_image_bytes,
        max_images_per_request=args.max_images_per_request,
        image_fetch_timeout_s=args.image_fetch_timeout,
        image_nice=args.image_nice,
        allowed_media_domains=",".join(d.strip() for d in (args.allowed_media_domains or "").split(",") if d.strip()),
        json_output=args.json_output,
        otlp_endpoint=args.otlp_endpoint or "",
        otlp_service_name=args.otlp_service_name,
        bus=bus_flags.bus_address(args.bus_address),  # "" until serve() names the run directory
        curve_secret_key=curve_secret,
        curve_public_key=curve_public,
        curve_client_secret_key=bus_flags.client_key(args.bus_curve_client_key),
        curve_allowed_keys=bus_flags.allowed_keys(args.bus_curve_allowed_keys),
        bus_insecure=args.bus_insecure,
        lora_adapters=lora_adapters,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        lora_fold=not args.disable_lora_fold,
        compile=args.compile,
        compile_buckets=args.compile_buckets,
        cuda_graphs=cuda_graphs,
        cuda_memory_fraction=cuda_memory_fraction,
        cpu_threads=cpu_threads,
        cpu_bind=cpu_bind,
        cpu_reserved=cpu_reserved,
        cpu_busy_share=cpu_busy_share,
    )


def check_lora_adapters(settings: Settings) -> None:
    """Each adapter read against the model's layers now (a DoRA adapter, one of another model, a rank above
    --max-lora-rank): exit 1 with the reason instead of shards that fail to start."""
    if not settings.lora_adapters:
        return
    from services.shard.lora.adapter import AdapterError, check_adapters

    folders = dict(entry.split("=", 1) for entry in settings.lora_adapters.split(","))
    try:
        check_adapters(settings.model_path, folders, max_rank=settings.max_lora_rank)
    except AdapterError as e:
        raise SystemExit(f"error: {e}") from None


def _lora_adapters(args: argparse.Namespace) -> str:
    """`--lora-adapters` resolved to local folders before any service starts (a Hub adapter is downloaded now),
    as Settings carries them: "name=/folder,…"; a malformed entry or a missing adapter stops the launcher."""
    if args.max_loras < 1 or args.max_lora_rank < 1:
        raise SystemExit("error: --max-loras and --max-lora-rank must be at least 1")
    try:
        specs = lora_flags.from_flag_or_env(args.lora_adapters)
        if len(specs) > args.max_loras:
            raise lora_flags.LoraFlagError(f"{len(specs)} LoRA adapters given, more than --max-loras {args.max_loras}")
        folders = lora_flags.resolve_all(specs)
    except lora_flags.LoraFlagError as e:
        raise SystemExit(f"error: {e}") from None
    if any("," in str(f) or "=" in name for name, f in folders.items()):
        raise SystemExit("error: a LoRA adapter's name or folder contains `,` or `=`, which --lora-adapters reserves")
    return ",".join(f"{name}={folder}" for name, folder in folders.items())


CUDA_GRAPHS_DEFAULT = (1, 2, 4, 8, 16, 32)  # TGI's default for --cuda-graphs


def parse_cuda_graphs(flag: str | None) -> tuple[int, ...]:
    """TGI's `--cuda-graphs`: a comma list of decode batch sizes, sorted and deduplicated; zeros are dropped, so "0"
    disables graphs; unset (None) gives TGI's default. Raises ValueError on anything but non-negative integers."""
    if flag is None:
        return CUDA_GRAPHS_DEFAULT
    sizes = set()
    for part in flag.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit():
            raise ValueError(f"--cuda-graphs takes a comma list of batch sizes (0 disables), not {flag!r}")
        sizes.add(int(part))
    sizes.discard(0)
    return tuple(sorted(sizes))


def _cuda_flags(args: argparse.Namespace) -> tuple[str, float]:
    """--cuda-graphs as TGI reads it, as Settings carries it ("1,2,4", "" for none), and --cuda-memory-fraction,
    checked; both act on CUDA shards only."""
    try:
        buckets = parse_cuda_graphs(args.cuda_graphs)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if not 0.0 < args.cuda_memory_fraction <= 1.0:
        raise SystemExit(f"error: --cuda-memory-fraction must be in (0, 1], not {args.cuda_memory_fraction}")
    return ",".join(map(str, buckets)), args.cuda_memory_fraction


def _cpu_flags(args: argparse.Namespace) -> tuple[str, str, str, str]:
    """--cpu-threads, --cpu-bind, --cpu-reserved and --cpu-busy-share (or VLLM_CPU_OMP_THREADS_BIND,
    VLLM_CPU_NUM_OF_RESERVED_CPU), checked against this process's usable cores, as Settings carries them."""
    threads = getattr(args, "cpu_threads", None) or "auto"
    bind = getattr(args, "cpu_bind", None) or "auto"
    reserved = getattr(args, "cpu_reserved", None) or "auto"
    busy_share = getattr(args, "cpu_busy_share", None) or ""
    try:
        cpu_team.parse_flags(threads, bind, reserved, cpu_team.usable_cpus(), busy_share)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    return str(threads), "none" if bind == "nobind" else bind, str(reserved), str(busy_share)


def omp_environment(settings: Settings, environ=None, others: dict[int, float] | None = None) -> dict[str, str]:
    """OpenMP's wait policy for the programs, read once when OpenMP loads, so decided here, at start: PASSIVE
    when other processes already load the cores (cpu_team.decide; `others` measured now unless given), unless
    OMP_WAIT_POLICY is set."""
    environ = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in environ:
        return {}
    if others is None:
        sampler = cpu_team.Sampler()
        time.sleep(cpu_team.START_WINDOW_S)
        others = sampler.sample()
    plan = cpu_team.decide(cpu_team.usable_cpus(), others, cpu_team.flags_from(settings), settings.procs_shard)
    if not plan.wait_policy:
        return {}
    log.info("OMP_WAIT_POLICY=%s for the shards: %s", plan.wait_policy, plan.reason)
    return {"OMP_WAIT_POLICY": plan.wait_policy}


def _origins(given: list[str] | None) -> str:
    """The origins, comma-joined as Settings holds them: repeated flags, or the environment's comma list."""
    values = given if given is not None else [os.environ.get("CORS_ALLOW_ORIGIN", "")]
    return ",".join(o.strip() for v in values for o in v.split(",") if o.strip())


def _chat_template(value: str | None) -> str:
    """A template given inline, or the content of the file it names."""
    if not value:
        return ""
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:  # e.g. a template so long it is not a valid path
        pass
    if "{" not in value and ("/" in value or value.endswith((".jinja", ".j2", ".txt"))):
        raise SystemExit(f"error: --chat-template {value!r}: no such file")
    return value
