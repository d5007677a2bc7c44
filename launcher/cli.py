"""`switchyard serve`: TGI's launcher flags → Settings → supervisord in the foreground.

Every flag also reads its environment variable as TGI's launcher does (`--model-id` ← MODEL_ID,
`--port` ← PORT, …). The launcher resolves the model once (Hub download or the embedded default),
makes a private run directory for the bus sockets, and runs supervisord with the six programs of
`supervisord.conf`. Ctrl-C (or SIGTERM) stops supervisord, which stops every program; the run
directory is removed on the way out, or by the next `switchyard serve` if the launcher was killed
outright (launcher/supervise.py, launcher/rundir.py). --tokenizer-workers, --detokenizer-workers,
--http-workers and --replicas (× --num-shard) set how many processes each program runs; --bus-address,
--only and the CURVE keys (launcher/bus_flags.py) spread a server over hosts (docs/deployment.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from pathlib import Path

from launcher import bus_flags, keygen, quantize, rundir, supervise, tap
from launcher.serve_settings import (
    IGNORED,
    SCHEDULING_POLICIES,
    SPECULATE_HELP,
    SPECULATE_POLICIES,
    check_lora_adapters,
    omp_environment,
    settings_from,
)
from libs.protocol import Addresses
from libs.runtime import cpu, cpu_team, model_store
from libs.runtime.settings import env_value
from services.http import reasoning as reasoning_parsers
from services.http import tool_parsers

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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="switchyard", description="A TGI-compatible text-generation server.")
    sub = p.add_subparsers(dest="command", required=True)
    tap.add_arguments(sub.add_parser("tap", help="print a running server's live token and text events"))
    from bench.serving import suite  # the benchmarks' flags; torch and the peers load only when one runs

    suite.add_arguments(sub.add_parser("bench", help="measure: the in-process limit, end to end, the peers"))
    keygen.add_arguments(sub.add_parser("keygen", help="print a new CURVE keypair for --bus-curve-secret-key"))
    s = sub.add_parser("serve", help="run every service under supervisord, in the foreground")

    def flag(name: str, type=str, default=None, help=None, choices=None):
        s.add_argument(f"--{name}", type=type, default=_env(name, default), help=help, choices=choices)

    flag("model-id", help=model_store.MODEL_ID_HELP)
    flag("revision", help="Hub revision (branch, tag or commit)")
    flag("dtype", default="auto", help=cpu.DTYPE_HELP)
    flag("quantize", help=quantize.help_text())
    flag("hostname", default="0.0.0.0")
    flag("port", type=int, default=3000)
    flag("max-concurrent-requests", type=int, default=128)
    flag(
        "graceful-termination-timeout",
        type=float,
        default=90.0,
        help="seconds running requests may finish after SIGTERM",
    )
    flag("max-best-of", type=int, default=2)
    flag("max-stop-sequences", type=int, default=4)
    flag("max-input-tokens", type=int, help="default: max-total-tokens − 1")
    flag("max-input-length", type=int, help="legacy alias of --max-input-tokens")
    flag("max-total-tokens", type=int, help="default: min(4096, the model's max_position_embeddings)")
    flag("max-batch-prefill-tokens", type=int, help="default: max(4096, max-input-tokens)")
    flag(
        "max-prefill-tokens-while-decoding",
        type=int,
        default=512,
        help="prompt tokens one step may prefill while other requests decode (0: no cap beyond "
        "max-batch-prefill-tokens, as TGI): a long prompt goes in chunks and running streams keep flowing",
    )
    flag(
        "max-prefill-ms-while-decoding",
        type=float,
        default=0.0,
        help="and at most what adds this many ms to a decode step, by the prefill cost per token measured on "
        "recent steps (0: no such cap); the smaller of the two caps wins",
    )
    flag(
        "prefill-saturation-tokens",
        type=int,
        default=512,
        help="a step takes no further prompt once its prefill holds this many tokens (0: fill "
        "max-batch-prefill-tokens, as TGI): prompts of a burst get their first token one after the other",
    )
    flag("max-batch-total-tokens", type=int, help="KV cache size in tokens (default: max(65536, max-total-tokens))")
    flag("max-batch-size", type=int, default=256)
    flag(
        "cuda-graphs",
        help="decode batch sizes captured as CUDA graphs: a comma list, 0 disables (default 1,2,4,8,16,32; "
        "CUDA only, no effect on CPU)",
    )
    flag(
        "cuda-memory-fraction",
        type=float,
        default=1.0,
        help="the share of each GPU's memory a shard may allocate (CUDA only, no effect on CPU)",
    )
    flag("speculate", type=int, help=SPECULATE_HELP)
    flag(
        "speculate-policy",
        choices=SPECULATE_POLICIES,
        default="adaptive",
        help="adaptive: draft only where the measured price of a drafted position says it pays; always: draft every "
        "match that fits (to measure what the adaptive rule saves)",
    )
    flag(
        "scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default="fcfs",
        help="fcfs: requests run in arrival order; priority: by each request's `priority` (vLLM's: lower first), "
        "a request that outranks the worst running one preempting it (it resumes later from its own tokens)",
    )
    flag(
        "priority-aging-seconds",
        type=float,
        default=30.0,
        help="with --scheduling-policy priority: each this many seconds a request has waited count as one priority "
        "level, so no request waits forever behind later ones (0: strict priority)",
    )
    flag(
        "shard-stall-timeout",
        type=float,
        default=60.0,
        help="seconds a step may take before the scheduler reports its shards hung (/health 503 until it returns)",
    )
    s.add_argument("--cpu-threads", default=_env("cpu-threads"),
                   metavar="N|auto", help=cpu_team.THREADS_HELP)  # fmt: skip
    s.add_argument("--cpu-bind", default=_env("cpu-bind", os.environ.get("VLLM_CPU_OMP_THREADS_BIND")),
                   metavar="auto|none|LIST", help=cpu_team.BIND_HELP)  # fmt: skip
    s.add_argument("--cpu-reserved", default=_env("cpu-reserved", os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU")),
                   metavar="N|auto", help=cpu_team.RESERVED_HELP)  # fmt: skip
    s.add_argument("--cpu-busy-share", default=_env("cpu-busy-share"), metavar="F", help=cpu_team.BUSY_SHARE_HELP)
    flag("num-shard", type=int, default=1, help="tensor-parallel shards per replica (gloo on CPU, NCCL on CUDA)")
    flag("replicas", type=int, default=1, help="model replicas: a scheduler and num-shard shards each")
    flag(
        "replica-base",
        type=int,
        default=0,
        help="the index of this host's first replica, for a host that adds replicas to a running router",
    )
    flag(
        "worker-base",
        type=int,
        default=0,
        help="the index of this host's first tokenizer and detokenizer, for a host that brings its own to a running "
        "router (another model's)",
    )
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
        default=bus_flags.env_default("--bus-curve-secret-key", "curve_secret_key"),
        metavar="KEY|FILE",
        help=f"encrypt the tcp bus with CURVE: the deployment's secret key, or a file holding it (switchyard "
        f"keygen); needed where the router or a scheduler runs. Prefer env BUS_CURVE_SECRET_KEY or "
        f"{bus_flags.SECRET_VAR}, or a file: a command line is visible to other users",
    )
    s.add_argument(
        "--bus-curve-public-key",
        default=bus_flags.env_default("--bus-curve-public-key", "curve_public_key"),
        metavar="KEY|FILE",
        help=f"the public half (or a file holding it; env BUS_CURVE_PUBLIC_KEY or {bus_flags.PUBLIC_VAR}), for "
        "hosts that only connect",
    )
    s.add_argument(
        "--bus-curve-client-key",
        default=bus_flags.env_default("--bus-curve-client-key", "curve_client_secret_key"),
        metavar="KEY|FILE",
        help=f"this host's client secret key, or a file holding it (switchyard keygen --client; env "
        f"BUS_CURVE_CLIENT_KEY or {bus_flags.CLIENT_SECRET_VAR}): what its processes present to a bus that "
        "lists its allowed clients (default: the deployment's pair where the secret is held, else none)",
    )
    s.add_argument(
        "--bus-curve-allowed-keys",
        default=bus_flags.env_default("--bus-curve-allowed-keys", "curve_allowed_keys"),
        metavar="FILE",
        help="client public keys the router and schedulers let in, one a line (`# ` comments; keygen --client's "
        "public lines work), re-read when it changes; any other key is refused (env BUS_CURVE_ALLOWED_KEYS)",
    )
    s.add_argument(
        "--bus-insecure",
        action="store_true",
        default=_env_bool("bus-insecure") or env_value("bus_insecure") in ("1", "true"),
        help="run a tcp bus without CURVE on purpose (refused otherwise): plaintext and unauthenticated",
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
    flag(
        "tool-call-parser",
        choices=tool_parsers.NAMES,
        help="the model's tool-call format (default: from the chat template; tgi: TGI's tool prompt and shape)",
    )
    flag(
        "reasoning-parser",
        choices=reasoning_parsers.NAMES,
        help="how reasoning is split from the answer (default: from the chat template; none: no split)",
    )
    flag("otlp-endpoint", help="OpenTelemetry collector (gRPC) to export traces to")
    flag(
        "lora-adapters",
        help="LoRA adapters to serve, comma-separated: `org/name`, `org/name@revision` (Hub) or `name=/local/path`; "
        "a request picks one with parameters.adapter_id (TGI) or `model` (OpenAI)",
    )
    flag("max-loras", type=int, default=8, help="LoRA adapters resident at once")
    flag("max-lora-rank", type=int, default=64, help="the largest LoRA rank an adapter may have")
    flag("otlp-service-name", default="text-generation-inference.router")
    flag("max-image-bytes", type=int, default=20 * 1024 * 1024, help="the largest image a request may send or name")
    flag("max-images-per-request", type=int, default=8, help="images one request may hold (vision models)")
    flag("image-fetch-timeout", type=float, default=10.0, help="seconds to fetch one image URL, redirects included")
    flag(
        "image-nice",
        type=int,
        default=19,
        help="the nice value (0-19) of the tokenizer's image threads: on busy cores, decoding goes before images",
    )
    flag(
        "allowed-media-domains",
        default="",
        help="comma-separated hosts whose image URLs are fetched even at loopback, private or link-local addresses "
        "(refused otherwise)",
    )

    def switch(name: str, help: str):
        s.add_argument(f"--{name}", action="store_true", default=_env_bool(name), help=help)

    switch("disable-grammar-support", "refuse requests with a `grammar`")
    switch(
        "disable-lora-fold",
        "keep LoRA's shrink out of the base oneDNN product: saves the adapted linears' second packing (their size "
        "in memory) at the cost of slower mixed steps",
    )
    switch("json-output", "log one JSON object per line")
    s.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=_env_bool("compile"),
        help="bf16 on CPU: the decoder walk's layers compiled by inductor at start, one graph per kind of layer (fused "
        "elementwise work around the oneDNN products; kernels cached under the model cache's inductor/); float32 "
        "always stays eager",
    )
    flag("compile-buckets", default="1,2", help="token counts run through the compiled step at start")
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
    check_lora_adapters(settings)
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
        bus = settings.bus or f"ipc://{run_dir}"
        settings = settings.replace(bus=bus, run_dir=run_dir, procs_shard=counts["shard"])
        if settings.num_shard > 1 and counts["shard"]:  # each replica's ranks rendezvous on one of these
            settings = settings.replace(tp_port=_free_ports(settings.replicas))
        try:  # fail now, not in every process, if the address is unusable
            Addresses.parse(settings.bus).replica(settings.replica_base + settings.replicas - 1, "results")
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        env = {
            **os.environ,
            **settings.to_env(),
            # supervisord.conf's: how many processes each program runs, the python and the repository to run
            **{f"SWITCHYARD_PROCS_{role.upper()}": str(n) for role, n in counts.items()},
            "SWITCHYARD_PYTHON": sys.executable,
            "SWITCHYARD_ROOT": str(ROOT),
            "PYTHONUNBUFFERED": "1",
            **omp_environment(settings),
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
            drain_timeout=settings.graceful_termination_timeout,
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
        from bench.serving import suite

        return suite.run(args)
    if args.command == "keygen":
        return keygen.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
