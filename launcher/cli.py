"""`switchyard serve`: TGI's launcher flags → Settings → supervisord in the foreground.

Every flag also reads its environment variable as TGI's launcher does (`--model-id` ← MODEL_ID,
`--port` ← PORT, …). The launcher resolves the model once (Hub download or the embedded default),
makes a private run directory for the bus sockets, and runs supervisord with the six programs of
`supervisord.conf`. Ctrl-C (or SIGTERM) stops supervisord, which stops every program; the run
directory is removed on the way out. If the launcher is killed outright, supervisord gets the
parent-death signal and stops the server all the same, and the next `switchyard serve` removes the
run directory left behind (launcher/supervise.py, launcher/rundir.py).

Scale-out: --tokenizer-workers, --detokenizer-workers, --http-workers, --replicas (× --num-shard)
set how many processes each program runs; --bus-address puts the bus on tcp instead of the run
directory's ipc sockets, and --only runs a subset of the programs, so one host can run the router
and the http side while another runs the schedulers and shards (docs/deployment.md). A tcp bus binds
loopback unless a host is named, and --bus-curve-secret-key (`switchyard keygen`) encrypts it with
CURVE (launcher/bus_flags.py).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import shutil
import sys
from pathlib import Path

from launcher import bench, bus_flags, keygen, lora_flags, quantize, rundir, supervise, tap
from libs.protocol import Addresses
from libs.runtime import cpu, model_store
from libs.runtime.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
ROLES = ("router", "scheduler", "shard", "tokenizer", "detokenizer", "http")  # supervisord.conf's programs
log = logging.getLogger("switchyard.launcher")


def _env(flag: str, default=None):
    return os.environ.get(flag.upper().replace("-", "_"), default)


def _env_bool(flag: str) -> bool:
    # clap's falsey values for a flag read from the environment; anything else set means on
    raw = _env(flag)
    return raw is not None and raw.strip().lower() not in ("", "0", "false", "f", "no", "n", "off")


def _bool_value(raw: str) -> bool:
    """A flag that takes true/false (TGI's `--sharded <bool>`)."""
    value = raw.strip().lower()
    if value not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {raw!r}")
    return value == "true"


def _env_sharded() -> bool | None:
    raw = _env("sharded")
    try:
        return None if raw is None else _bool_value(raw)
    except argparse.ArgumentTypeError as e:
        raise SystemExit(f"error: SHARDED: {e}") from None


# TGI flags that are accepted so a TGI command line runs unchanged, but do nothing here (yet):
# (name, type or "flag", TGI's default, what it does in TGI). A value other than the default is logged.
IGNORED = [
    ("speculate", int, None, "speculative decoding (n-gram/medusa); tokens are generated one at a time"),
    ("kv-cache-dtype", str, None, "fp8 KV cache; the KV cache uses --dtype"),
    ("trust-remote-code", "flag", False, "custom model code from the Hub; only transformers' own architectures run"),
    ("max-waiting-tokens", int, 20, "how long waiting requests wait before joining; here they join every step"),
    ("waiting-served-ratio", float, 0.3, "when waiting requests force a prefill; here new prefills join every step"),
    ("cuda-graphs", str, None, "CUDA graph batch sizes; no CUDA graphs are captured"),
    ("cuda-memory-fraction", float, 1.0, "GPU memory share; the KV cache is sized by --max-batch-total-tokens"),
    ("disable-custom-kernels", "flag", False, "no custom kernels are used anyway"),
    ("prometheus-port", int, 9000, "a separate metrics port; metrics are served on /metrics of --port"),
    ("usage-stats", str, "on", "telemetry; none is ever sent"),
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="switchyard", description="A TGI-compatible text-generation server.")
    sub = p.add_subparsers(dest="command", required=True)
    tap.add_arguments(sub.add_parser("tap", help="print a running server's live token and text events"))
    bench.add_arguments(sub.add_parser("bench", help="measure: the in-process limit, end to end, the peers"))
    keygen.add_arguments(sub.add_parser("keygen", help="print a new CURVE keypair for --bus-curve-secret-key"))
    s = sub.add_parser("serve", help="run every service under supervisord, in the foreground")

    def flag(name: str, type=str, default=None, help=None):
        s.add_argument(f"--{name}", type=type, default=_env(name, default), help=help)

    flag("model-id", help=model_store.MODEL_ID_HELP)
    flag("revision", help="Hub revision (branch, tag or commit)")
    flag("dtype", default="auto", help=cpu.DTYPE_HELP)
    flag("quantize", help=quantize.help_text())
    flag("hostname", default="0.0.0.0")
    flag("port", type=int, default=3000)
    flag("max-concurrent-requests", type=int, default=128)
    flag("max-best-of", type=int, default=2)
    flag("max-stop-sequences", type=int, default=4)
    flag("max-input-tokens", type=int, help="default: max-total-tokens − 1")
    flag("max-input-length", type=int, help="legacy alias of --max-input-tokens")
    flag("max-total-tokens", type=int, help="default: min(4096, the model's max_position_embeddings)")
    flag("max-batch-prefill-tokens", type=int, help="default: max(4096, max-input-tokens)")
    flag("max-batch-total-tokens", type=int, help="KV cache size in tokens (default: max(65536, max-total-tokens))")
    flag("max-batch-size", type=int, default=256)
    flag(
        "shard-stall-timeout",
        type=float,
        default=60.0,
        help="seconds a step may take before the scheduler reports its shards hung (/health 503 until it returns)",
    )
    flag("num-shard", type=int, default=1, help="tensor-parallel shards per replica (gloo on CPU, NCCL on CUDA)")
    flag("replicas", type=int, default=1, help="model replicas: a scheduler and num-shard shards each")
    flag("tokenizer-workers", type=int, default=1, help="tokenizer processes")
    flag("detokenizer-workers", type=int, default=1, help="detokenizer processes")
    flag("http-workers", type=int, default=1, help="http processes, all on --port (SO_REUSEPORT)")
    flag(
        "bus-address",
        help="tcp://host:port[?replicas=host:port[,…]]: the bus on tcp (router on port…port+4, replica r on "
        "port+10+3r…, or where ?replicas says) instead of ipc sockets in the run directory; a host left out "
        "(tcp://:5550, or just 5550) is 127.0.0.1",
    )
    s.add_argument(
        "--bus-curve-secret-key",
        default=os.environ.get(bus_flags.SECRET_VAR),
        metavar="KEY|FILE",
        help=f"encrypt the tcp bus with CURVE: the deployment's secret key, or a file holding it (switchyard "
        f"keygen); needed where the router or a scheduler runs. Prefer env {bus_flags.SECRET_VAR} or a file: "
        "a command line is visible to other users",
    )
    s.add_argument(
        "--bus-curve-public-key",
        default=os.environ.get(bus_flags.PUBLIC_VAR),
        metavar="KEY|FILE",
        help=f"the public half (or a file holding it; env {bus_flags.PUBLIC_VAR}), for hosts that only connect",
    )
    flag("only", help=f"comma-separated programs to run here (default: all of {','.join(ROLES)})")
    flag("max-client-batch-size", type=int, default=4)
    flag("validation-workers", type=int, default=2, help="reported in /info; must be > 0")
    flag("max-top-n-tokens", type=int, default=5, help="the largest top_n_tokens a request may ask for")
    flag("payload-limit", type=int, default=2_000_000, help="largest request body in bytes (larger: 413)")
    flag("api-key", help="when set, generation routes need `Authorization: Bearer <key>`")
    s.add_argument(
        "--cors-allow-origin",
        action="append",
        default=None,
        help="an allowed CORS origin; repeat the flag (or give a comma-separated list) for several; "
        "env CORS_ALLOW_ORIGIN: comma-separated",
    )
    flag("watermark-gamma", type=float, default=0.5, help="share of the vocabulary in the watermark's green list")
    flag("watermark-delta", type=float, default=2.0, help="bias added to green-list logits")
    flag("chat-template", help="a Jinja chat template replacing the model's: the template itself or a file holding it")
    flag("otlp-endpoint", help="OpenTelemetry collector (gRPC) to export traces to")
    flag(
        "lora-adapters",
        help="LoRA adapters to serve, comma-separated: `org/name`, `org/name@revision` (Hub) or `name=/local/path`; "
        "a request picks one with parameters.adapter_id (TGI) or `model` (OpenAI)",
    )
    flag("max-loras", type=int, default=8, help="LoRA adapters resident at once")
    flag("max-lora-rank", type=int, default=64, help="the largest LoRA rank an adapter may have")
    flag("otlp-service-name", default="text-generation-inference.router")

    def switch(name: str, help: str):
        s.add_argument(f"--{name}", action="store_true", default=_env_bool(name), help=help)

    switch("disable-grammar-support", "refuse requests with a `grammar`")
    switch("json-output", "log one JSON object per line")
    switch(
        "enable-prefill-logprobs",
        "accepted for compatibility: prompt logprobs are always computed for a request that asks for them "
        "(decoder_input_details), with or without this flag",
    )
    s.add_argument(
        "--sharded",
        type=_bool_value,
        default=_env_sharded(),
        help="true | false; true needs --num-shard > 1, false refuses it (as TGI)",
    )
    for name, type_, default, what in IGNORED:
        help = f"accepted for compatibility with TGI and ignored: {what}"
        if type_ == "flag":
            switch(name, help)
        else:
            flag(name, type=type_, default=default, help=help)
    return p


def _dtype(requested: str, model_path: Path) -> str:
    """The serving dtype, chosen here once (so /info can say it) by the rule in libs/runtime/cpu.py."""
    import torch  # not at import time: `switchyard tap --help` should not pay for torch

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
    if args.validation_workers < 1:
        raise SystemExit("error: `validation_workers` must be > 0")
    curve_secret, curve_public = bus_flags.curve_keys(args.bus_curve_secret_key, args.bus_curve_public_key)
    lora_adapters = _lora_adapters(args)
    try:
        quantization = quantize.resolve(args.quantize, model_path)
    except quantize.QuantizeError as e:
        raise SystemExit(f"error: {e}") from None
    if quantization and args.num_shard > 1:
        raise SystemExit("error: --quantize with --num-shard > 1 is not supported yet (scales are not split)")
    for name, _, default, _ in IGNORED:
        value = getattr(args, name.replace("-", "_"))
        if value != default:
            log.warning("--%s is accepted for compatibility and ignored", name)
    return Settings(
        model_path=str(model_path),
        model_id=args.model_id or model_store.DEFAULT_MODEL_NAME,
        dtype=_dtype(args.dtype, model_path),
        quantize=quantization or "",
        hostname=hostname,
        port=args.port,
        max_concurrent_requests=args.max_concurrent_requests,
        max_best_of=args.max_best_of,
        max_stop_sequences=args.max_stop_sequences,
        max_input_tokens=max_input,
        max_total_tokens=max_total,
        max_batch_prefill_tokens=prefill,
        max_batch_total_tokens=total,
        max_batch_size=args.max_batch_size,
        shard_stall_timeout=args.shard_stall_timeout,
        replicas=args.replicas,
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
        disable_grammar_support=args.disable_grammar_support,
        json_output=args.json_output,
        otlp_endpoint=args.otlp_endpoint or "",
        otlp_service_name=args.otlp_service_name,
        bus=bus_flags.bus_address(args.bus_address),  # "" until serve() names the run directory
        curve_secret_key=curve_secret,
        curve_public_key=curve_public,
        lora_adapters=lora_adapters,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
    )


def _check_lora_adapters(settings: Settings) -> None:
    """Each adapter read against the model's layers now (a DoRA adapter, one of another model, a rank above
    --max-lora-rank): exit 1 with the reason instead of shards that fail to start."""
    if not settings.lora_adapters:
        return
    from services.shard.lora_adapter import AdapterError, check_adapters

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


def programs(args: argparse.Namespace) -> dict[str, int]:
    """How many processes each supervisord program runs here (0: not on this host)."""
    only = [r.strip() for r in (args.only or ",".join(ROLES)).split(",") if r.strip()]
    unknown = sorted(set(only) - set(ROLES))
    if unknown or not only:
        raise SystemExit(f"error: --only takes programs among {','.join(ROLES)}; got {args.only!r}")
    counts = {
        "router": 1,
        "scheduler": args.replicas,
        "shard": args.replicas * args.num_shard,  # shard i: replica i // num_shard, rank i % num_shard
        "tokenizer": args.tokenizer_workers,
        "detokenizer": args.detokenizer_workers,
        "http": args.http_workers,
    }
    return {role: n if role in only else 0 for role, n in counts.items()}


def _origins(given: list[str] | None) -> str:
    """The origins, comma-joined as Settings holds them: repeated flags, or the environment's comma list."""
    values = given if given is not None else [_env("cors-allow-origin", "")]
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


def _free_ports(n: int) -> int:
    """The first of n consecutive tcp ports free on 127.0.0.1 now (the tensor-parallel rendezvous)."""
    import socket

    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise SystemExit(f"error: found no {n} consecutive free tcp ports for the tensor-parallel rendezvous")


def serve(args: argparse.Namespace) -> int:
    try:
        model_path = model_store.resolve_model(args.model_id, revision=args.revision, token=os.environ.get("HF_TOKEN"))
    except model_store.ModelNotAvailableError as e:
        raise SystemExit(f"error: {e}") from None
    settings = settings_from(args, model_path)
    _check_lora_adapters(settings)
    counts = programs(args)
    bus_flags.check(settings, counts)
    for stale in rundir.remove_stale():  # only servers provably dead: their lock is free (launcher/rundir.py)
        log.info("removed the run directory %s of a server that is no longer running", stale)
    try:
        path, lock_fd = rundir.create()  # 0700; locked for as long as this server lives
    except OSError as e:
        raise SystemExit(f"error: cannot make a run directory under {rundir.root()}: {e}") from None
    run_dir = str(path)
    try:
        settings = settings.replace(bus=settings.bus or f"ipc://{run_dir}")
        if settings.num_shard > 1 and counts["shard"]:  # each replica's ranks rendezvous on one of these
            settings = settings.replace(tp_port=_free_ports(settings.replicas))
        try:  # fail now, not in every process, if the address is unusable
            Addresses.parse(settings.bus).replica(settings.replicas - 1, "results")
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        env = {
            **os.environ,
            **settings.to_env(),
            **{f"SWITCHYARD_PROCS_{role.upper()}": str(n) for role, n in counts.items()},
            "SWITCHYARD_RUN_DIR": run_dir,
            "SWITCHYARD_PYTHON": sys.executable,
            "SWITCHYARD_ROOT": str(ROOT),
            "PYTHONUNBUFFERED": "1",
        }
        host, port = settings.hostname, settings.port
        here = ", ".join(f"{role}×{n}" for role, n in counts.items() if n)
        log.info("serving %s on %s:%d (run directory %s)", settings.model_id, host, port, run_dir)
        log.info("programs: %s; bus %s", here, settings.bus)
        url = f"http://{_url_host(host)}:{port}"
        ready = f"ready: {settings.model_id} at {url} (Ctrl-C to stop)"
        return supervise.run(
            ROOT / "supervisord.conf",
            env,
            ROOT,
            path,
            lock_fd=lock_fd,
            health_url=f"{url}/health" if counts["http"] else None,
            ready_message=ready,
        )
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        os.close(lock_fd)


def _url_host(hostname: str) -> str:
    """Where a client on this machine reaches a server listening on `hostname`."""
    if hostname in ("0.0.0.0", ""):
        return "127.0.0.1"
    if hostname == "::":
        return "[::1]"
    return f"[{hostname}]" if ":" in hostname else hostname


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s launcher: %(message)s")
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "tap":
        return tap.run(args)
    if args.command == "bench":
        return bench.run(args)
    if args.command == "keygen":
        return keygen.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
