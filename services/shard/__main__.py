"""`python -m services.shard`: hold the model, run each plan, send back the sampled tokens."""

from __future__ import annotations

import os

import torch
import zmq

from libs.protocol import Addresses
from libs.protocol.messages import ShardReady, StepPlan, StepResult
from libs.runtime import bus, service
from libs.runtime.settings import BLOCK_SIZE, Settings
from services.shard.model_runner import ModelRunner

ROLE = "shard"


class ShardService:
    def __init__(self, settings: Settings, rank: int = 0):
        self.rank = rank
        addresses = Addresses.parse(settings.bus)
        replica = 0  # one replica for now; its index comes with scale-out
        self.plans = bus.socket(zmq.SUB, connect=addresses.replica(replica, "plan"))
        self.plans.setsockopt(zmq.SUBSCRIBE, b"")
        self.results = bus.socket(zmq.PUSH, connect=addresses.replica(replica, "results"))
        # one accelerator per shard when there is one (rank r takes device r), else the CPU
        device = f"cuda:{rank}" if torch.cuda.is_available() else "cpu"
        self.runner = ModelRunner(
            settings.model_path,
            num_blocks=settings.num_blocks,
            block_size=BLOCK_SIZE,
            dtype=getattr(torch, settings.dtype),
            device=device,
            watermark_gamma=settings.watermark_gamma,
            watermark_delta=settings.watermark_delta,
        )
        self.num_blocks = settings.num_blocks

    def run(self, log) -> None:
        got_plan = False
        while True:
            if not self.plans.poll(500):
                if not got_plan:  # keep knocking until the scheduler's probe reaches us
                    bus.send(self.results, ShardReady(rank=self.rank, pid=os.getpid(), num_blocks=self.num_blocks))
                continue
            plan = bus.recv(self.plans)
            if not isinstance(plan, StepPlan):
                continue
            got_plan = True
            if plan.step == 0:  # a (new) scheduler's probe: start from a clean slate
                self.runner.seqs.clear()
                result = StepResult(step=0, rank=self.rank)
            else:
                try:
                    result = self.runner.execute(plan)
                except Exception as e:  # a failed step fails its requests, not the process
                    log.exception("step %d failed", plan.step)
                    result = StepResult(step=plan.step, rank=self.rank, error=f"{type(e).__name__}: {e}")
            if self.rank == 0:
                bus.send(self.results, result)


def main() -> None:
    def body(settings: Settings, log) -> None:
        torch.set_num_threads(int(os.environ.get("SWITCHYARD_TORCH_THREADS", os.cpu_count() or 1)))
        shard = ShardService(settings, rank=settings.index)
        log.info(
            "model loaded from %s (%s on %s); %d KV blocks",
            settings.model_path,
            settings.dtype,
            shard.runner.device,
            settings.num_blocks,
        )
        shard.run(log)

    service.run(ROLE, body)


if __name__ == "__main__":
    main()
