"""`switchyard bench --workload vision`: what an image costs a request, and whether image preprocessing stalls decoding.

The model: a LLaVA 1.5-shaped vision-language model with random weights, built here without the Hub (a CLIP tower
at LLaVA 1.5's input, 336 px in patches of 14: 576 image tokens per image, smaller than its ViT-L; a projector; the
`--model` shape's Llama with the benchmark tokenizer and an `<image>` token), served through a no-EOS view by a
real server. `--model` names the text shape (smollm2, tiny, llama-128k) or a local vision-model folder.

1. Levels: at each `--vision-concurrency` c, TTFT, ITL and output tok/s of requests carrying one image (a
   `--vision-image-size` picture drawn with PIL from a fixed seed, PNG and JPEG in turn, each request its own, as a
   TGI markdown `data:` URI) against text-only requests of the same prompt token count and text-only requests of
   the same text without the image. The kinds take turns (ABBA over `--vision-rounds`); /metrics gives each row's
   images per request and preprocessing time (tokenizer) and, at c=1, the encoder time per image (shard).
2. The flood check: `--vision-streams` text streams decode while image requests arrive at `--vision-flood-rate`
   per second, against the same streams alone (ABBA again). The server runs with `--max-batch-size` equal to the
   streams, so the flood's requests are fetched, decoded and preprocessed by the tokenizer processes and carried
   to the scheduler's queue, but not prefilled while the streams run: the gap ratio is what the image path
   outside the model costs decoding. Each process's CPU seconds in the window say where the flood went.

results.json, results.md and results.png go to the output folder.

    switchyard bench --workload vision --model smollm2
    switchyard bench --workload vision --model tiny --vision-concurrency 1,4 --vision-streams 4
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench import clock, machine, models
from bench.serving import cpu_cost, loadgen, servers
from bench.serving.workload import Prompts

# LLaVA 1.5's image input (CLIP ViT-L/14-336: 24 x 24 patches, the CLS feature dropped); the tower itself smaller
IMAGE_SIDE, PATCH = 336, 14
TOWERS = {
    "smollm2": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8),
    "llama-128k": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2),
}
IMAGE_TOKEN = "<image>"
KINDS = ("image", "text, same tokens", "text, no image")
DIALECT = loadgen.Dialect("tgi")


def add_arguments(p) -> None:
    p.add_argument("--vision-concurrency", default="1,16", help="vision workload: comma-separated client counts")
    p.add_argument("--vision-prompt-tokens", type=int, default=32, help="vision workload: text tokens beside "
                   "each request's image")  # fmt: skip
    p.add_argument("--vision-output-tokens", type=int, default=32, help="vision workload: new tokens per request")
    p.add_argument("--vision-turn", type=int, default=4, help="vision workload: at least this many requests per "
                   "turn (a whole number of waves of c)")  # fmt: skip
    p.add_argument("--vision-rounds", type=int, default=2, help="vision workload: turns per kind and level (ABBA "
                   "order)")  # fmt: skip
    p.add_argument("--vision-image-size", default="640x480", help="vision workload: WIDTHxHEIGHT of the pictures")
    p.add_argument("--vision-streams", type=int, default=16, help="vision workload: text streams of the flood check "
                   "(the server's --max-batch-size; no level may exceed it)")  # fmt: skip
    p.add_argument("--vision-stream-tokens", type=int, default=256, help="vision workload: new tokens per stream "
                   "of the flood check")  # fmt: skip
    p.add_argument("--vision-flood-rounds", type=int, default=4, help="vision workload: rounds of the flood check, "
                   "alone and with the flood in turn (ABBA order)")  # fmt: skip
    p.add_argument("--vision-flood-rate", type=float, default=16.0, help="vision workload: image requests per "
                   "second arriving during the flood (0 skips the flood check)")  # fmt: skip


def _say(msg: str) -> None:
    print(msg, flush=True)


def _ms(values: list[float], q: float) -> float | None:
    v = loadgen.percentile(values, q)
    return None if v is None else v * 1000


# ---- the model and the pictures -------------------------------------------------------------------------------
def build_llava(shape: str) -> Path:
    """Build (once) the LLaVA 1.5-shaped model whose language model has `shape` (a key of bench.models.SHAPES)."""
    out = models.CACHE / f"llava-{shape}"
    if (out / "model.safetensors").exists():
        return out
    import torch
    from tokenizers import AddedToken, Tokenizer
    from transformers import (
        CLIPVisionConfig,
        GenerationConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    vocab = models.VOCABS.get(shape, models.VOCAB)
    tok_dir = models.build_tokenizer(models.CACHE / ("tokenizer" if vocab == models.VOCAB else f"tokenizer-{vocab}"))
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "tokenizer_config.json").write_bytes((tok_dir / "tokenizer_config.json").read_bytes())
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    tok.save(str(tmp / "tokenizer.json"))
    text = LlamaConfig(vocab_size=tok.get_vocab_size(), pad_token_id=0, bos_token_id=1, eos_token_id=2,
                       **models.SHAPES[shape])  # fmt: skip
    vision = CLIPVisionConfig(image_size=IMAGE_SIDE, patch_size=PATCH, **TOWERS.get(shape, TOWERS["smollm2"]))
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=tok.token_to_id(IMAGE_TOKEN),
                         vision_feature_layer=-2, vision_feature_select_strategy="default")  # fmt: skip
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).to(torch.float32)  # transformers' own init: realistic magnitudes
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(tmp, safe_serialization=True)
    images = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIDE},
                                   crop_size={"height": IMAGE_SIDE, "width": IMAGE_SIDE})  # fmt: skip
    processor = LlavaProcessor(image_processor=images, tokenizer=PreTrainedTokenizerFast.from_pretrained(tmp),
                               patch_size=PATCH, vision_feature_select_strategy="default",
                               num_additional_image_tokens=1)  # fmt: skip
    processor.save_pretrained(tmp)
    tmp.rename(out)
    return out


def picture(seed: int, size: tuple[int, int], fmt: str) -> bytes:
    """A photo-like picture (soft colour fields, a dozen shapes, a little sensor noise): it compresses as a photo
    does (PNG ~0.5 MB, JPEG ~50 KB at 640x480), unlike pure noise or flat colour."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFilter

    rng = np.random.default_rng(seed)
    w, h = size
    img = Image.fromarray((rng.random((6, 8, 3)) * 255).astype("uint8")).resize(size, Image.BICUBIC)
    draw = ImageDraw.Draw(img)
    for _ in range(12):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        box = [x0, y0, x0 + int(rng.integers(20, w // 2)), y0 + int(rng.integers(20, h // 2))]
        fill = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=fill)
    pixels = np.asarray(img.filter(ImageFilter.GaussianBlur(2))).astype(np.int16)
    pixels += rng.normal(0, 4, pixels.shape).astype(np.int16)
    buf = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype("uint8")).save(
        buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {})
    )
    return buf.getvalue()


class Pictures:
    """Distinct pictures as data: URIs, PNG and JPEG in turn, from seeds counted up: no two measured requests share
    one, so neither the prefix cache nor the encoder's batching sees the same image twice (the flood's requests,
    which are never prefilled, take turns over a pool of them)."""

    def __init__(self, size: tuple[int, int], seed: int = 0):
        self.size, self.next = size, seed
        self.bytes: dict[str, list[int]] = {"PNG": [], "JPEG": []}

    def uri(self) -> str:
        fmt = ("PNG", "JPEG")[self.next % 2]
        data = picture(self.next, self.size, fmt)
        self.next += 1
        self.bytes[fmt].append(len(data))
        return f"data:image/{fmt.lower()};base64," + base64.b64encode(data).decode()


@dataclass
class Jobs:
    """The three kinds of request, cut alike: the image's prompt, its text-only twin of the same token count,
    and the same text without the image."""

    prompts: Prompts
    pictures: Pictures
    text_tokens: int
    image_prompt_tokens: int
    output_tokens: int

    def make(self, kind: str, count: int, output_tokens: int | None = None) -> list[loadgen.Job]:
        out = output_tokens or self.output_tokens
        length = self.image_prompt_tokens if kind == "text, same tokens" else self.text_tokens
        jobs = []
        for _ in range(count):
            text, n = self.prompts.make(length)
            while IMAGE_TOKEN in text:  # a text that names the image token would be read as an image
                text, n = self.prompts.make(length)
            if kind == "image":
                jobs.append(loadgen.Job(f"![]({self.pictures.uri()})\n{text}", self.image_prompt_tokens, out))
            else:
                jobs.append(loadgen.Job(text, n, out))
        return jobs


# ---- /metrics -------------------------------------------------------------------------------------------------
IMAGE_METRICS = ("switchyard_request_images", "switchyard_image_preprocess_seconds", "switchyard_image_encode_seconds")


async def _metrics(session, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as resp:
        return loadgen.parse_metrics(await resp.text())


class Ledger:
    """The image metrics against what this run has sent. A tokenizer counts every request (the images it carried, 0
    for text, and their preprocessing time: one snapshot of its metrics), a scheduler every encoder step; both reach
    /metrics in the metrics texts that heartbeats carry, a beat or more late. `counted` polls until every request
    sent and every encoder step known to be due is there, so that a snapshot between two turns splits them. Encoder
    steps are known exactly only for images that come one at a time (c=1): several at once share steps."""

    def __init__(self, url: str):
        self.url, self.base = url, None
        self.requests = 0  # requests sent
        self.encodes = 0  # encoder steps they must have taken (at least)

    def sent(self, requests: int, encodes: int = 0) -> None:
        self.requests += requests
        self.encodes += encodes

    async def counted(self, timeout: float = 30) -> dict[str, float]:
        """The image metrics' counts and sums once everything sent is counted (or, after `timeout`, as they are:
        then what was counted becomes the ledger's, so that a request the server never read stalls no later poll)."""
        async with loadgen.aiohttp.ClientSession() as session:
            deadline = time.monotonic() + timeout
            while True:
                m = await _metrics(session, self.url)
                now = {f"{n}_{s}": m.get(f"{n}_{s}", 0.0) for n in IMAGE_METRICS for s in ("count", "sum")}
                if self.base is None:
                    self.base = now
                seen = _delta(now, self.base)
                requests, encodes = (
                    seen["switchyard_request_images_count"],
                    seen["switchyard_image_encode_seconds_count"],
                )
                if requests >= self.requests and encodes >= self.encodes:
                    return now
                if time.monotonic() > deadline:
                    self.requests, self.encodes = int(requests), int(encodes)
                    return now
                await asyncio.sleep(0.1)


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


# ---- levels ---------------------------------------------------------------------------------------------------
async def _level(url: str, ledger: Ledger, jobs: Jobs, c: int, rounds: int, turn: int) -> list[dict]:
    """One row per kind at concurrency c: its turns alternate with the other kinds' (ABBA), so that a drift of the
    shared host's speed hits every kind alike (a turn starts once the last one's requests have all ended)."""
    for kind in KINDS:  # unmeasured: first use of this batch shape
        await loadgen.drive(url, DIALECT, jobs.make(kind, c, 2), c)
        ledger.sent(c, int(kind == "image"))  # images that come together are encoded in one step or more
    per = {k: {"samples": [], "wall": 0.0, "metrics": None} for k in KINDS}
    for r in range(rounds):
        for kind in KINDS if r % 2 == 0 else KINDS[::-1]:
            todo = jobs.make(kind, turn)
            before = await ledger.counted()
            samples, started, ended = await loadgen.drive(url, DIALECT, todo, c)
            encodes = (len(todo) if c == 1 else 1) if kind == "image" else 0  # c=1: one step each
            ledger.sent(len(todo), encodes)
            moved = _delta(await ledger.counted(), before)
            acc = per[kind]
            acc["samples"] += samples
            acc["wall"] += ended - started
            acc["metrics"] = moved if acc["metrics"] is None else {k: acc["metrics"][k] + moved[k] for k in moved}
    return [_row(kind, c, per[kind]) for kind in KINDS]


def _row(kind: str, c: int, acc: dict) -> dict:
    samples, m = acc["samples"], acc["metrics"]
    ok = [s for s in samples if s.error is None]
    ttfts = [s.ttft for s in ok if s.ttft is not None]
    gaps = [g for s in ok for g in s.gaps()]
    requests = m["switchyard_request_images_count"]
    images = m["switchyard_request_images_sum"]
    row = {"kind": kind, "concurrency": c, "requests": len(samples), "errors": len(samples) - len(ok),
           "first_error": next((s.error for s in samples if s.error), None),
           "prompt_tokens": samples[0].prompt_tokens if samples else None,
           "output_tokens": sum(s.tokens for s in ok), "wall_s": acc["wall"],
           "output_tok_s": sum(s.tokens for s in ok) / acc["wall"] if acc["wall"] else None,
           "ttft_p50_ms": _ms(ttfts, 50), "ttft_p90_ms": _ms(ttfts, 90), "itl_p50_ms": _ms(gaps, 50),
           "itl_p90_ms": _ms(gaps, 90), "counted_requests": requests,
           "images_per_request": images / requests if requests else None,
           "preprocess_ms_per_image": 1000 * m["switchyard_image_preprocess_seconds_sum"] / images
           if images else None}  # fmt: skip
    if c == 1:  # one image per encoder step, each turn's steps counted (Ledger): the tower and projector per image
        row["encoder_steps"] = m["switchyard_image_encode_seconds_count"]
        row["encode_ms_per_image"] = 1000 * m["switchyard_image_encode_seconds_sum"] / images if images else None
    return row


# ---- the flood check ------------------------------------------------------------------------------------------
async def _until_running(url: str, want: int, streams: list[asyncio.Task], timeout: float = 600) -> None:
    """Poll /metrics until `want` requests run (the streams all decode), or fail."""
    deadline = time.monotonic() + timeout
    async with loadgen.aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if any(t.done() for t in streams):
                raise RuntimeError(f"a stream ended before /metrics showed all {want} running: give them more tokens "
                                   "(--vision-stream-tokens)")  # fmt: skip
            _, batch = loadgen.kv_and_batch(await _metrics(session, url))
            if batch is not None and batch >= want:
                return
            await asyncio.sleep(0.05)
    raise TimeoutError(f"{want} streams never ran at once")


async def _until_idle(url: str, timeout: float = 300) -> None:
    """Poll /metrics until nothing runs or waits (the flood's aborted requests gone)."""
    deadline = time.monotonic() + timeout
    async with loadgen.aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            m = await _metrics(session, url)
            if not m.get("tgi_batch_current_size") and not m.get("tgi_queue_size"):
                return
            await asyncio.sleep(0.1)
    raise TimeoutError("the server never went idle after the flood")


async def _flood(url: str, pool: list[str], rate: float, prompt: str, sent: list[float]) -> None:
    """Image requests (one new token each) at `rate` per second until cancelled; cancelling closes them (the server
    aborts what it queued)."""

    async def one(session, uri: str) -> None:
        body = {"inputs": f"![]({uri})\n{prompt}", "parameters": {"max_new_tokens": 1}}
        async with session.post(url + "/generate_stream", json=body) as resp:
            await resp.read()

    tasks = []
    try:
        async with loadgen.aiohttp.ClientSession(connector=loadgen.aiohttp.TCPConnector(limit=0)) as session:
            start = time.monotonic()
            while True:
                i = len(sent)
                sent.append(time.monotonic())
                tasks.append(asyncio.ensure_future(one(session, pool[i % len(pool)])))
                await asyncio.sleep(max(0.0, start + (i + 1) / rate - time.monotonic()))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _streams_round(url: str, ledger: Ledger, jobs: list[loadgen.Job], flood: dict | None, root: int) -> dict:
    """The streams' gaps from the moment all run to the moment the first one ends, with or without the flood; each
    process's CPU seconds over that window."""
    tasks = [asyncio.ensure_future(loadgen.drive(url, DIALECT, [job], 1)) for job in jobs]
    await _until_running(url, len(jobs), tasks)
    ledger.sent(len(jobs))
    before = await ledger.counted()
    cpu = cpu_cost.ProcessCpu(root)
    cpu.start()
    start = clock.wall()
    sent: list[float] = []
    flooding = asyncio.ensure_future(_flood(url, **flood, sent=sent)) if flood else None
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    end = clock.wall()
    used = cpu.stop()
    if flooding:
        flooding.cancel()
        await asyncio.gather(flooding, return_exceptions=True)
    results = await asyncio.gather(*tasks)
    ledger.sent(len(sent))
    after = await ledger.counted(timeout=10)  # every flood request counted (one cancelled unread: not after 10 s)
    gaps = []
    for (sample,), _, _ in results:
        if sample.error is not None:
            raise RuntimeError(f"a stream failed: {sample.error}")
        per = sample.gaps()
        k = round(len(per) / max(1, len(sample.events) - 1))  # gaps per event (an event may carry several tokens)
        ends = [e for e in sample.events[1:] for _ in range(k)]
        gaps += [g for g, e in zip(per, ends) if start < e <= end]
    moved = _delta(after, before)
    return {"flood": bool(flood), "window_s": end - start, "gaps": gaps, "itl_p50_ms": _ms(gaps, 50),
            "load_1m": machine.load()[0], "flood_sent": len(sent),
            "flood_preprocessed": moved["switchyard_request_images_sum"],
            "preprocess_s": moved["switchyard_image_preprocess_seconds_sum"],
            "cpu_s": {role: round(s, 3) for role, s in sorted(used.items(), key=lambda kv: -kv[1])}}  # fmt: skip


async def _flood_check(url: str, ledger: Ledger, jobs: Jobs, args, root: int) -> dict:
    """The streams' gaps alone and with the flood, rounds in ABBA order; the ratios of the pooled gaps."""
    pool = [jobs.pictures.uri() for _ in range(32)]
    prompt = jobs.prompts.make(args.vision_prompt_tokens)[0]
    # unmeasured: a flood request and the streams' batch shape once, so that no round pays for a first use
    warm = [loadgen.Job(f"![]({pool[0]})\n{prompt}", jobs.image_prompt_tokens, 1)]
    warm += jobs.prompts.fixed(args.vision_streams, 64, 2)
    await loadgen.drive(url, DIALECT, warm, len(warm))
    ledger.sent(len(warm), 1)
    order = [False, True, True, False] * (args.vision_flood_rounds // 4) + [False, True, True][
        : args.vision_flood_rounds % 4
    ]
    rounds = []
    for flooded in order:
        await _until_idle(url)
        streams = jobs.prompts.fixed(args.vision_streams, 64, args.vision_stream_tokens)
        flood = {"pool": pool, "rate": args.vision_flood_rate, "prompt": prompt} if flooded else None
        r = await _streams_round(url, ledger, streams, flood, root)
        _say(f"  {'flood' if flooded else 'alone':<5} {len(r['gaps']):5d} gaps in {r['window_s']:5.1f} s  "
             f"p50 {_ms(r['gaps'], 50) or 0:6.1f} ms  images sent {r['flood_sent']:4d}, preprocessed "
             f"{r['flood_preprocessed']:4.0f}")  # fmt: skip
        rounds.append(r)
    await _until_idle(url)
    out = {"streams": args.vision_streams, "stream_tokens": args.vision_stream_tokens, "rate": args.vision_flood_rate,
           "rounds": [{k: v for k, v in r.items() if k != "gaps"} for r in rounds]}  # fmt: skip
    for name, flooded in (("alone", False), ("flood", True)):
        gaps = [g for r in rounds if r["flood"] == flooded for g in r["gaps"]]
        window = sum(r["window_s"] for r in rounds if r["flood"] == flooded)
        cpu: dict[str, float] = {}
        for r in rounds:
            if r["flood"] == flooded:
                for role, s in r["cpu_s"].items():
                    cpu[role] = cpu.get(role, 0.0) + s
        out[name] = {"gaps": len(gaps), "window_s": window, "itl_p50_ms": _ms(gaps, 50), "itl_p99_ms": _ms(gaps, 99),
                     "itl_mean_ms": 1000 * sum(gaps) / len(gaps) if gaps else None,
                     "cpu_per_s": {role: s / window for role, s in sorted(cpu.items(), key=lambda kv: -kv[1])}
                     if window else {},
                     "images_preprocessed": sum(r["flood_preprocessed"] for r in rounds if r["flood"] == flooded),
                     "images_sent": sum(r["flood_sent"] for r in rounds if r["flood"] == flooded),
                     # the shard's CPU per model step (a step gives each stream a token): the same work per step
                     # with less CPU to do it in, or more work per step
                     "shard_cpu_ms_per_step": 1000 * cpu.get("shard", 0.0) * args.vision_streams / len(gaps)
                     if gaps else None}  # fmt: skip
    for key in ("itl_p50_ms", "itl_mean_ms", "itl_p99_ms", "shard_cpu_ms_per_step"):
        a, f = out["alone"][key], out["flood"][key]
        out[f"ratio_{key.removeprefix('itl_').removesuffix('_ms')}"] = f / a if a and f is not None else None
    return out


# ---- the run --------------------------------------------------------------------------------------------------
def _model(args) -> tuple[str, Path, str]:
    """(label, no-EOS folder, how it was made)."""
    if args.model in models.SHAPES:
        folder = build_llava(args.model)
        tower = TOWERS.get(args.model, TOWERS["smollm2"])
        how = (f"random-weight LLaVA 1.5 shape built locally (no VLM on this machine): CLIP tower "
               f"{tower['hidden_size']} wide, {tower['num_hidden_layers']} layers, "
               f"{IMAGE_SIDE} px in patches of {PATCH} ({(IMAGE_SIDE // PATCH) ** 2} image tokens); "
               f"{args.model}'s Llama")  # fmt: skip
        return f"llava-{args.model}", models.no_eos_view(folder), how
    label, view = models.resolve(args.model)
    return label, view, f"the folder {args.model}"


async def _image_prompt_tokens(url: str, ledger: Ledger, jobs: Jobs) -> tuple[int, int]:
    """(prompt tokens of an image request, of its text alone) as the server counts them."""
    await ledger.counted()  # the metrics before any request
    ledger.sent(2, 1)
    text, _ = jobs.prompts.make(jobs.text_tokens)
    counts = []
    async with loadgen.aiohttp.ClientSession() as session:
        for inputs in (f"![]({jobs.pictures.uri()})\n{text}", text):
            body = {"inputs": inputs, "parameters": {"max_new_tokens": 1, "details": True,
                                                     "decoder_input_details": True}}  # fmt: skip
            async with session.post(url + "/generate", json=body) as resp:
                got = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"an image request failed: HTTP {resp.status} {got}")
            counts.append(len(got["details"]["prefill"]))
    return counts[0], counts[1]


def run(args, out: Path) -> int:
    from libs.runtime import cpu

    label, view, how = _model(args)
    dtype = cpu.choose_dtype(None).dtype if args.dtype == "auto" else args.dtype
    levels = sorted(int(x) for x in args.vision_concurrency.split(",") if x.strip())  # c=1 first (see Ledger)
    if levels and max(levels) > args.vision_streams:
        raise SystemExit("error: --vision-concurrency above --vision-streams (the server's --max-batch-size)")
    w, h = (int(x) for x in args.vision_image_size.lower().split("x"))
    results = {"title": f"{label}: one image per request ({w}x{h} PNG/JPEG) against text only ({dtype})",
               "model": label, "model_made": how, "dtype": dtype, "cpu": machine.processor(),
               "machine": machine.info(), "command": " ".join(sys.argv), "levels": [], "flood": None}  # fmt: skip
    _say(f"switchyard bench --workload vision: {results['title']}\n  model: {how}\n  CPU {results['cpu']}; "
         f"results in {out}")  # fmt: skip
    # the flood's requests stay open in the scheduler's queue behind the full batch: room for them all
    flags = ["--dtype", dtype, "--max-batch-size", str(args.vision_streams), "--max-concurrent-requests", "4096",
             *args.serve_flag]  # fmt: skip
    with servers.switchyard(view, out / "switchyard.log", *flags) as srv:
        srv.wait_healthy(600)
        jobs = Jobs(Prompts(view, seed=1), Pictures((w, h)), args.vision_prompt_tokens, 0, args.vision_output_tokens)
        ledger = Ledger(srv.url)
        image_tokens, text_tokens = asyncio.run(_image_prompt_tokens(srv.url, ledger, jobs))
        jobs.image_prompt_tokens = image_tokens
        results["prompt_tokens"] = {"image": image_tokens, "text": text_tokens}
        _say(f"  an image request: {image_tokens} prompt tokens ({image_tokens - text_tokens} more than its text)")
        for c in levels:
            turn = -(-max(args.vision_turn, c) // c) * c
            rows = asyncio.run(_level(srv.url, ledger, jobs, c, args.vision_rounds, turn))
            for r in rows:
                _say(f"  c={c:<3} {r['kind']:<17} {r['output_tok_s'] or 0:7.1f} tok/s  TTFT p50 "
                     f"{r['ttft_p50_ms'] or 0:7.0f} ms  ITL p50 {r['itl_p50_ms'] or 0:6.1f} ms  images/request "
                     f"{r['images_per_request'] or 0:.2f}  errors {r['errors']}")  # fmt: skip
            results["levels"] += rows
            _write(results, out)
        if args.vision_flood_rate > 0:
            results["flood"] = asyncio.run(_flood_check(srv.url, ledger, jobs, args, srv.proc.pid))
    results["image_kib_mean"] = {fmt: sum(b) / len(b) / 1024 for fmt, b in jobs.pictures.bytes.items() if b}
    results["machine"]["load_avg_end"] = machine.load()
    paths = _write(results, out)
    _say(table(results))
    _say(f"written: {', '.join(str(p) for p in paths)}")
    failed = [r for r in results["levels"] if r["errors"]]
    return 1 if failed else 0


# ---- report ---------------------------------------------------------------------------------------------------
def _f(v, digits: int = 0) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def table(results: dict) -> str:
    lines = [f"### {results['title']} — CPU {results['cpu']}", "", f"Model: {results['model_made']}.", ""]
    if results.get("prompt_tokens"):
        p = results["prompt_tokens"]
        sizes = ", ".join(f"{fmt} {kib:.0f} KiB" for fmt, kib in results.get("image_kib_mean", {}).items())
        lines += [
            f"An image request: {p['image']} prompt tokens, {p['image'] - p['text']} more than its text alone"
            + (f" (pictures on average: {sizes})." if sizes else "."),
            "",
        ]
    if results["levels"]:
        lines += ["| c | kind | prompt tokens | out tok/s | TTFT p50 / p90 ms | ITL p50 / p90 ms | images per request "
                  "| preprocess ms per image | encoder ms per image | errors |",
                  "|---:|---|---:|---:|---|---|---:|---:|---:|---:|"]  # fmt: skip
        for r in results["levels"]:
            lines.append(f"| {r['concurrency']} | {r['kind']} | {_f(r['prompt_tokens'])} | {_f(r['output_tok_s'], 1)} "
                         f"| {_f(r['ttft_p50_ms'])} / {_f(r['ttft_p90_ms'])} "
                         f"| {_f(r['itl_p50_ms'], 1)} / {_f(r['itl_p90_ms'], 1)} | {_f(r['images_per_request'], 2)} "
                         f"| {_f(r['preprocess_ms_per_image'], 1)} | {_f(r.get('encode_ms_per_image'), 1)} "
                         f"| {r['errors']} |")  # fmt: skip
        lines.append("")
        ratios = []
        for c in sorted({r["concurrency"] for r in results["levels"]}):
            by = {r["kind"]: r for r in results["levels"] if r["concurrency"] == c}
            img, same = by.get("image"), by.get("text, same tokens")
            if img and same and img["output_tok_s"] and same["output_tok_s"] and same["ttft_p50_ms"]:
                ratios.append(f"c={c}: TTFT ×{img['ttft_p50_ms'] / same['ttft_p50_ms']:.2f}, "
                              f"tok/s ×{img['output_tok_s'] / same['output_tok_s']:.2f}")  # fmt: skip
        if ratios:
            lines += ["Image against text of the same prompt tokens (p50 TTFT, output tok/s): " + "; ".join(ratios), ""]
    fl = results.get("flood")
    if fl:
        lines += [f"Flood check: {fl['streams']} text streams decoding, alone and while image requests arrive at "
                  f"{fl['rate']:g}/s (preprocessed by the tokenizers, queued behind the full batch):", "",
                  "| streams | gaps | ITL p50 ms | ITL mean ms | ITL p99 ms | images sent / preprocessed "
                  "| shard CPU ms per step | CPU s per s, by process |",
                  "|---|---:|---:|---:|---:|---|---:|---|"]  # fmt: skip
        for name in ("alone", "flood"):
            r = fl[name]
            cpu = ", ".join(f"{role} {v:.2f}" for role, v in r["cpu_per_s"].items() if v >= 0.01)
            lines.append(
                f"| {name} | {r['gaps']} | {_f(r['itl_p50_ms'], 1)} | {_f(r['itl_mean_ms'], 1)} "
                f"| {_f(r['itl_p99_ms'], 1)} | {r['images_sent']} / {r['images_preprocessed']:.0f} "
                f"| {_f(r['shard_cpu_ms_per_step'], 1)} | {cpu} |"
            )
        lines += ["", f"Gap with the flood / alone: p50 ×{_f(fl['ratio_p50'], 3)}, mean ×{_f(fl['ratio_mean'], 3)}, "
                  f"p99 ×{_f(fl['ratio_p99'], 3)} (within 10 %: p50 {_verdict(fl['ratio_p50'])}); the shard's CPU "
                  f"per step ×{_f(fl['ratio_shard_cpu_ms_per_step'], 3)}",
                  "Rounds (ITL p50 ms, load average): " + ", ".join(
                      f"{'flood' if r['flood'] else 'alone'} {_f(r['itl_p50_ms'], 1)} ({r['load_1m']:.1f})"
                      for r in fl["rounds"])]  # fmt: skip
    return "\n".join(lines)


def _verdict(ratio: float | None) -> str:
    return "–" if ratio is None else ("yes" if ratio <= 1.10 else "no")


def plot(results: dict, path: Path) -> Path:
    """Two panels: TTFT p50 and output tok/s per kind against concurrency; the flood check's gap percentiles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4.5))
    for a, key, label in ((ax[0], "ttft_p50_ms", "TTFT p50 (ms)"), (ax[1], "output_tok_s", "output tok/s")):
        for kind in KINDS:
            pts = sorted((r["concurrency"], r[key]) for r in results["levels"] if r["kind"] == kind and r[key])
            if pts:
                a.plot(*zip(*pts), marker="o", label=kind)
        levels = sorted({r["concurrency"] for r in results["levels"]})
        a.set_xscale("log", base=2)
        if levels:
            a.set_xticks(levels, [str(c) for c in levels])
        a.set_xlabel("concurrency")
        a.set_ylabel(label)
        a.grid(True, alpha=0.3)
        a.legend(fontsize=8)
    fl = results.get("flood")
    if fl:
        keys = [("itl_p50_ms", "p50"), ("itl_mean_ms", "mean"), ("itl_p99_ms", "p99")]
        x = range(len(keys))
        for i, name in enumerate(("alone", "flood")):
            ax[2].bar([j + 0.4 * i for j in x], [fl[name][k] or 0 for k, _ in keys], width=0.4, label=name)
        ax[2].set_xticks([j + 0.2 for j in x], [label for _, label in keys])
        ax[2].set_ylabel(f"inter-token gap of {fl['streams']} streams (ms)")
        ax[2].set_title(f"image flood {fl['rate']:g}/s", fontsize=9)
        ax[2].legend(fontsize=8)
    fig.suptitle(f"{results['title']} — {results['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _write(results: dict, out: Path) -> list[Path]:
    paths = [out / "results.json", out / "results.md", out / "results.png"]
    paths[0].write_text(json.dumps(results, indent=1))
    paths[1].write_text(table(results) + "\n")
    plot(results, paths[2])
    return paths
