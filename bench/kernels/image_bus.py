"""What an image's pixels cost the processes they cross, as float32 (the processor's values) and as uint8 bytes (its
values before rescale and normalize, which the shard finishes: services/shard/vision/pixels.py), per image.

Per form it prints the CPU ms (this process's, zmq's I/O thread included), the median over --reps, of:
- `processor`: the tokenizer's image processor on one decoded picture (CLIP's PIL path, LLaVA 1.5's 336 px), whole or
  without its rescale and normalize;
- `hop request`: one bus hop of the TokenizedRequest that carries the image (encode, send and receive over ipc://,
  decode), as tokenizer → router and router → scheduler each make;
- `plan`: the scheduler taking the request's image into a StepPlan's frames and that plan's hop to the shard;
- `shard open`: the shard's image out of the plan's frames into float32 values (the bytes finished first).

    python -m bench.kernels.image_bus [--side 336] [--picture 640x480] [--reps 50] [--json]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time

import numpy as np
import zmq

from bench import clock
from libs.protocol import codec
from libs.protocol.messages import ImageInput, image_pixels, pixel_frames
from libs.protocol.params import SamplingParams
from libs.protocol.step_messages import NewSequence, StepPlan
from services.scheduler.images import images_to_feed, plan_pixels
from services.shard.vision.pixels import PixelFinisher


def cpu_ms(fn, reps: int) -> float:
    return statistics.median(clock.times(fn, reps, warm=True, clock=time.process_time)) * 1000


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--side", type=int, default=336, help="the processor's crop (LLaVA 1.5: 336)")
    p.add_argument("--picture", default="640x480", help="the decoded picture's size, WxH")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from PIL import Image
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from bench.workloads.vision.model import picture

    size = tuple(int(v) for v in args.picture.split("x"))
    img = Image.open(io.BytesIO(picture(0, size, "PNG"))).convert("RGB")
    ip = CLIPImageProcessorPil(size={"shortest_edge": args.side}, crop_size={"height": args.side, "width": args.side})
    folder = tempfile.mkdtemp(prefix="image-bus-")
    ip.save_pretrained(folder)
    finisher = PixelFinisher(folder)
    forms = {
        "float32": ({}, lambda px: px.astype(np.float32)),
        "uint8": ({"do_rescale": False, "do_normalize": False}, lambda px: px),
    }
    ctx = zmq.Context()
    address = f"ipc://{folder}/hop"
    pull = ctx.socket(zmq.PULL)
    pull.bind(address)
    push = ctx.socket(zmq.PUSH)
    push.connect(address)

    def hop(msg):
        push.send_multipart(codec.encode(msg), copy=False)
        return codec.decode(pull.recv_multipart(copy=False))

    rows, want = {}, ip(images=[img], return_tensors="np")["pixel_values"][0]
    for form, (kwargs, cast) in forms.items():
        row = {"processor": cpu_ms(lambda kwargs=kwargs: ip(images=[img], return_tensors="np", **kwargs), args.reps)}
        px = cast(ip(images=[img], return_tensors="np", **kwargs)["pixel_values"][0])
        im = ImageInput(digest="d" * 32, start=1, tokens=576, shape=list(px.shape), dtype=str(px.dtype))
        req = codec.decode(codec.encode(_request(im, px)))
        row["bytes"] = px.nbytes
        row["hop request"] = cpu_ms(lambda req=req: hop(req), args.reps)

        def plan(req=req):
            images, pixels = images_to_feed(req, 0)
            new = NewSequence(seq=1, sampling=SamplingParams(), images=images)
            return hop(StepPlan(step=1, new=[new], **_rows(), **plan_pixels(pixels)))

        row["plan"] = cpu_ms(plan, args.reps)
        got = plan()

        def shard_open(got=got):
            (flat,) = image_pixels(got.new[0].images, got.pixel_values, got.pixel_bytes)
            return np.array(finisher.values(got.new[0].images[0], flat), np.float32)

        row["shard open"] = cpu_ms(shard_open, args.reps)
        if shard_open().tobytes() != want.tobytes():
            raise AssertionError(f"{form}: the shard's pixel values are not the processor's")
        rows[form] = row
    push.close(0), pull.close(0), ctx.term()
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        return 0
    parts = ("processor", "hop request", "plan", "shard open")
    print(f"{'form':8} {'bytes':>9} " + " ".join(f"{p + ' ms':>16}" for p in parts))
    for form, row in rows.items():
        print(f"{form:8} {row['bytes']:>9} " + " ".join(f"{row[p]:>16.3f}" for p in parts))
    return 0


def _request(im: ImageInput, px: np.ndarray):
    from libs.protocol.messages import TokenizedRequest

    return TokenizedRequest(
        request_id="r" * 32,
        ingress=0,
        input_ids=np.arange(600, dtype=np.int32),
        sampling=SamplingParams(),
        max_new_tokens=32,
        images=[im],
        **pixel_frames([px.ravel()]),
    )


def _rows() -> dict:
    one = np.ones(1, np.int32)
    return {
        "seqs": one, "num_tokens": np.array([600], np.int32), "context_lens": np.zeros(1, np.int32),
        "token_ids": np.arange(600, dtype=np.int32), "sample": np.ones(1, np.uint8), "drafts": np.zeros(0, np.int32),
    }  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
