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

results.json, results.md and results.png go to the output folder. model.py builds the model and the requests,
ledger.py reads the image metrics, flood.py runs the flood check, report.py writes the results.

    switchyard bench --workload vision --model smollm2
    switchyard bench --workload vision --model tiny --vision-concurrency 1,4 --vision-streams 4
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from bench import machine, models
from bench.serving import loadgen, servers
from bench.serving.workload import Prompts
from bench.workloads.vision import flood, report
from bench.workloads.vision.ledger import Ledger, delta
from bench.workloads.vision.model import DIALECT, IMAGE_SIDE, KINDS, PATCH, TOWERS, Jobs, Pictures, build_llava
from bench.workloads.vision.report import ms, say, table


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
            moved = delta(await ledger.counted(), before)
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
           "ttft_p50_ms": ms(ttfts, 50), "ttft_p90_ms": ms(ttfts, 90), "itl_p50_ms": ms(gaps, 50),
           "itl_p90_ms": ms(gaps, 90), "counted_requests": requests,
           "images_per_request": images / requests if requests else None,
           "preprocess_ms_per_image": 1000 * m["switchyard_image_preprocess_seconds_sum"] / images
           if images else None}  # fmt: skip
    if c == 1:  # one image per encoder step, each turn's steps counted (Ledger): the tower and projector per image
        row["encoder_steps"] = m["switchyard_image_encode_seconds_count"]
        row["encode_ms_per_image"] = 1000 * m["switchyard_image_encode_seconds_sum"] / images if images else None
    return row


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
    say(f"switchyard bench --workload vision: {results['title']}\n  model: {how}\n  CPU {results['cpu']}; "
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
        say(f"  an image request: {image_tokens} prompt tokens ({image_tokens - text_tokens} more than its text)")
        for c in levels:
            turn = -(-max(args.vision_turn, c) // c) * c
            rows = asyncio.run(_level(srv.url, ledger, jobs, c, args.vision_rounds, turn))
            for r in rows:
                say(f"  c={c:<3} {r['kind']:<17} {r['output_tok_s'] or 0:7.1f} tok/s  TTFT p50 "
                     f"{r['ttft_p50_ms'] or 0:7.0f} ms  ITL p50 {r['itl_p50_ms'] or 0:6.1f} ms  images/request "
                     f"{r['images_per_request'] or 0:.2f}  errors {r['errors']}")  # fmt: skip
            results["levels"] += rows
            report.write(results, out)
        if args.vision_flood_rate > 0:
            results["flood"] = asyncio.run(flood.check(srv.url, ledger, jobs, args, srv.proc.pid))
    results["image_kib_mean"] = {fmt: sum(b) / len(b) / 1024 for fmt, b in jobs.pictures.bytes.items() if b}
    results["machine"]["load_avg_end"] = machine.load()
    paths = report.write(results, out)
    say(table(results))
    say(f"written: {', '.join(str(p) for p in paths)}")
    failed = [r for r in results["levels"] if r["errors"]]
    return 1 if failed else 0
