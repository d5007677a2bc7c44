"""Settings of a running Switchyard, passed from the launcher to every service as environment.

The launcher (`switchyard serve`) turns TGI-style flags into one `Settings`, writes them into the
environment of supervisord's programs as `SWITCHYARD_<FIELD>`, and each service reads them back
with `Settings.from_env()`. Services never parse flags of their own, so one place decides defaults.

This module is the only reader of SWITCHYARD_* variables: code elsewhere gets a Settings (or a value taken from
one) as an argument, and the few variables the launcher reads before any Settings exist (the CURVE keys as flag
defaults, the run root, the embedded models' cache) go through `env_value`. A field with no flag (`SWITCHES`) is
passed on from the launcher's own environment to every service.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

BLOCK_SIZE = 16  # tokens per KV block
PREFIX = "SWITCHYARD_"


def _parse(type_name, raw: str):
    if type_name in ("int", int):
        return int(raw)
    if type_name in ("float", float):
        return float(raw)
    if type_name in ("bool", bool):
        return raw.strip().lower() in ("1", "true", "yes", "on")
    return raw


@dataclass(frozen=True)
class Settings:
    bus: str = ""  # ipc:///run/dir or tcp://host:port (libs.protocol.addresses)
    model_path: str = ""  # local folder of the resolved model
    model_id: str = ""  # what /info reports
    model_sha: str = ""  # Hub commit when known
    dtype: str = "auto"  # the launcher resolves it (libs/runtime/cpu.py); a shard resolves "auto" itself
    quantize: str = ""  # --quantize as resolved by launcher/quantize.py ("": the weights as stored)
    hostname: str = "0.0.0.0"
    port: int = 3000
    max_concurrent_requests: int = 128
    # seconds an http process lets running requests finish after SIGTERM, refusing new ones (TGI's flag)
    graceful_termination_timeout: float = 90.0
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_input_tokens: int = 4095
    max_total_tokens: int = 4096
    max_batch_prefill_tokens: int = 4096
    # prompt tokens one step may prefill while other requests decode (0: up to max_batch_prefill_tokens, as TGI):
    # a long prompt fed in chunks keeps the streams flowing (docs/scheduling.md)
    max_prefill_tokens_while_decoding: int = 512
    # and at most what adds this many ms to a decode step, by the prefill cost per token of recent steps (0: no
    # such cap); the smaller of the two caps wins. Off by default: under load its chunks shrink too far
    max_prefill_ms_while_decoding: float = 0.0
    # a step takes no further prompt once its prefill holds this many tokens (0: it fills max_batch_prefill_tokens,
    # as TGI): one more long prompt in a saturated step only delays the first (docs/scheduling.md)
    prefill_saturation_tokens: int = 512
    max_batch_total_tokens: int = 65536
    max_batch_size: int = 256
    speculate: int = 0  # --speculate: tokens drafted per decode row by prompt lookup and verified (0: off)
    # --speculate-policy: "adaptive" drafts only what its measured price says pays; "always" drafts every match
    # that fits (to measure what the adaptive rule saves, and for tests whose drafts must happen on any machine)
    speculate_policy: str = "adaptive"
    # --scheduling-policy: "fcfs" (arrival order, as TGI) or "priority" (a request's `priority`, lower first; one that
    # outranks the worst running request preempts it); --priority-aging-seconds: waiting this long is worth one
    # priority level, which bounds starvation (0: no aging). services/scheduler/priority.py, docs/scheduling.md
    scheduling_policy: str = "fcfs"
    priority_aging_s: float = 30.0
    # seconds a step may take before the scheduler says its shards hang (not ready: /health 503) until it returns
    shard_stall_timeout: float = 60.0
    validation_workers: int = 1
    max_client_batch_size: int = 4
    replicas: int = 1  # model replicas: one scheduler each, with num_shard shards
    # the index of this launcher's first replica (--replica-base): a host adding replicas to a running fleet numbers
    # its schedulers and shards after the others' (libs/runtime/service.py makes their index global)
    replica_base: int = 0
    # the index of this launcher's first tokenizer and detokenizer (--worker-base): a host that brings its own (another
    # model's) to a running router numbers them after the others' (libs/runtime/service.py makes their index global)
    worker_base: int = 0
    num_shard: int = 1  # shards (tensor-parallel ranks) per replica
    tokenizer_workers: int = 1
    detokenizer_workers: int = 1
    http_workers: int = 1  # http processes sharing the port (SO_REUSEPORT)
    # TGI's flags, accepted and ignored as TGI v3 ignores them when it chunks: waiting requests join at the next step
    max_waiting_tokens: int = 20
    waiting_served_ratio: float = 1.2
    max_top_n_tokens: int = 5
    payload_limit: int = 2_000_000  # bytes of a request body; larger → 413
    api_key: str = ""  # when set, generation routes need `Authorization: Bearer <key>`
    cors_allow_origin: str = ""  # comma-separated origins, or "" for any origin (TGI)
    watermark_gamma: float = 0.5
    watermark_delta: float = 2.0
    chat_template: str = ""  # overrides the model's chat template (a Jinja string)
    # the tool-call format (services/http/tool_parsers: hermes, llama3_json, mistral, pythonic, or "tgi" for TGI's
    # tool prompt and shape); "" = chosen from the chat template (--tool-call-parser, vLLM's name)
    tool_call_parser: str = ""
    # the reasoning format (services/http/reasoning: think, deepseek_r1, qwen3, or "none"); "" = from the template
    reasoning_parser: str = ""
    disable_grammar_support: bool = False
    # structured output limits per request (services.tokenizer.grammar.GrammarLimits): schema/grammar text
    # bytes, schema nesting, and the wall clock of one compile
    grammar_max_bytes: int = 256 * 1024
    grammar_max_depth: int = 64
    grammar_compile_timeout_s: float = 5.0
    # a vision model's images (services/tokenizer/images): bytes of one image (--max-image-bytes), pixels its header
    # may claim (decompression bombs), images per request, a URL fetch's seconds and redirects, and the hosts fetched
    # even at loopback/private/link-local addresses (--allowed-media-domains, comma-separated)
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 50_000_000
    max_images_per_request: int = 8
    image_fetch_timeout_s: float = 10.0
    image_fetch_max_redirects: int = 3
    allowed_media_domains: str = ""
    # the nice value of the tokenizer's image threads (images/lane.py): on busy cores decoding comes first
    image_nice: int = 19
    json_output: bool = False  # logs as one JSON object per line
    otlp_endpoint: str = ""  # OpenTelemetry collector (gRPC), "" = no tracing export
    otlp_service_name: str = "text-generation-inference.router"
    index: int = 0  # this process's index within its role (supervisord's process_num)
    # CURVE on tcp bus links (libs.runtime.bus.Curve), Z85 text; "" = off. One keypair per deployment:
    # binders (router, schedulers) need the secret; connectors need only the public half (derived from
    # the secret when only that is given). Never logged (--bus-curve-secret-key, `switchyard keygen`)
    curve_secret_key: str = dataclasses.field(default="", repr=False)
    curve_public_key: str = ""
    # client authentication on the CURVE bus (libs/runtime/bus_auth.py): the binders accept only the client public
    # keys listed in this file (besides the deployment's own), re-read when it changes ("" = any client with the
    # server's public key); a connecting process presents curve_client_secret_key's keypair (never logged)
    curve_allowed_keys: str = ""
    curve_client_secret_key: str = dataclasses.field(default="", repr=False)
    # a tcp bus without CURVE is refused unless this is set (--bus-insecure): a plaintext bus is a choice
    bus_insecure: bool = False
    # tensor parallel (num_shard > 1): replica r's ranks rendezvous on 127.0.0.1:tp_port + r (the launcher
    # picks free ports; the ranks of a replica share a host)
    tp_port: int = 0
    # LoRA adapters served from the start: "name=/local/folder,…" (the launcher resolves Hub ids to folders first);
    # the shards load them, http and the tokenizer validate requests' adapters against the names
    lora_adapters: str = ""
    max_loras: int = 8  # adapters resident at once
    max_lora_rank: int = 64
    # the stacked LoRA shrink folded into the base oneDNN product (services/shard/lora/fold.py): off with
    # --disable-lora-fold, which saves the adapted linears' second packing
    lora_fold: bool = True
    # CUDA only (no effect on CPU): the decode batch sizes captured as CUDA graphs, --cuda-graphs as resolved by
    # services/shard/graphs.py ("": none), and the share of each GPU's memory a shard may allocate
    cuda_graphs: str = "1,2,4,8,16,32"
    # CPU, bf16: the decoder walk's body compiled by inductor at start (services/shard/model/compiled.py), run on
    # these token counts at start (--compile / --compile-buckets)
    compile: bool = False
    compile_buckets: str = "1,2"
    cuda_memory_fraction: float = 1.0
    # set by the launcher: the server's private run directory (launcher/rundir.py), where its ipc sockets, the
    # schedulers' LoRA records and a shard's "cannot-load" mark live ("": a process started by hand keeps none)
    run_dir: str = ""
    procs_shard: int = 1  # set by the launcher: the shard processes on this host, which share its cores
    # a CPU shard's OpenMP team (libs/runtime/cpu_team.py): --cpu-threads N|auto, --cpu-bind auto|none|0-3,5,
    # --cpu-reserved N|auto (cores kept for the other processes), --cpu-busy-share F, as given; the launcher has
    # checked them
    cpu_threads: str = "auto"
    cpu_bind: str = "auto"
    cpu_reserved: str = "auto"
    cpu_busy_share: str = ""  # --cpu-busy-share: "" is cpu_team.BUSY_SHARE
    # Switches without a flag, for comparisons and benchmarks: `switchyard serve` passes on those set in its own
    # environment (SWITCHES). torch threads per shard (0: the host's cores / procs_shard)
    torch_threads: int = 0
    decoder_walk: bool = (
        True  # the direct decoder walk where the architecture has one (0: transformers' forward everywhere)
    )
    # where structured output's masks are filled: "ahead" on a worker beside the forward pass, or "inline" on the
    # step's path with every core (services/shard/grammar/matchers.py)
    grammar_fill: str = "ahead"
    # a CPU shard makes its whole KV cache resident on a thread at idle priority beside the start, so that no step
    # pays for its blocks' first touch (0: pages on first use; services/shard/attention/kv_pages.py)
    kv_prefault: bool = True
    # a CPU shard in half precision runs the decode step's glue and short rows' attention through the C++ kernels
    # (services/shard/cpu_kernels/) where they build (0: torch's ops, to compare)
    cpu_kernels: bool = True

    @property
    def lora_names(self) -> list[str]:
        return [entry.split("=", 1)[0] for entry in self.lora_adapters.split(",") if entry]

    @property
    def num_blocks(self) -> int:
        """KV blocks of one replica: the scheduler allocates them, the shard holds them."""
        return -(-self.max_batch_total_tokens // BLOCK_SIZE)

    def to_env(self) -> dict[str, str]:
        return {env_name(f.name): str(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        return cls(**_read(env, [f.name for f in fields(cls)]))

    @classmethod
    def switches_from_env(cls, env: Mapping[str, str] | None = None) -> dict[str, object]:
        """The SWITCHES set in `env` (default os.environ), parsed: the launcher hands them on to every service."""
        return _read(env, SWITCHES)

    def replace(self, **changes) -> Settings:
        return dataclasses.replace(self, **changes)


SWITCHES = (
    "torch_threads",
    "decoder_walk",
    "grammar_fill",
    "kv_prefault",
    "cpu_kernels",
)  # fields with no flag (see above)


def env_name(name: str) -> str:
    """The environment variable of a field (or of a launcher-only variable): SWITCHYARD_<NAME>."""
    return PREFIX + name.upper()


def env_value(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """SWITCHYARD_<NAME> as given (None when unset), for what the launcher reads before any Settings exist: a
    flag's default (the CURVE keys), the run root, the embedded models' cache."""
    return (os.environ if env is None else env).get(env_name(name))


def _read(env: Mapping[str, str] | None, names) -> dict[str, object]:
    types = {f.name: f.type for f in fields(Settings)}
    values = {}
    for name in names:
        raw = env_value(name, env)
        if raw is not None:
            values[name] = _parse(types[name], raw)
    return values
