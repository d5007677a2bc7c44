"""`python -m services.shard`: hold the model, run each plan, send back the sampled tokens."""

from __future__ import annotations

import logging
import os

import torch
import zmq

from libs.protocol import Addresses
from libs.protocol.lora import ShardAdapters, ShardAdaptersAck
from libs.protocol.step_messages import ShardReady, StepPlan, StepResult
from libs.runtime import bus, cpu, cpu_team, heap, service
from libs.runtime.settings import BLOCK_SIZE, Settings
from services.shard import cpu_tuning, tensor_parallel
from services.shard.model_runner import ModelRunner

ROLE = "shard"


class ShardService:
    def __init__(self, settings: Settings, replica: int = 0, rank: int = 0):
        self.replica, self.rank = replica, rank
        addresses = Addresses.parse(settings.bus)
        self.plans = bus.socket(zmq.SUB, connect=addresses.replica(replica, "plan"))
        self.plans.setsockopt(zmq.SUBSCRIBE, b"")
        self.results = bus.socket(zmq.PUSH, connect=addresses.replica(replica, "results"))
        # one accelerator per shard when there is one (shard process i takes device i), else the CPU
        index = (replica - settings.replica_base) * settings.num_shard + rank  # among this host's shards
        device = f"cuda:{index % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
        if device != "cpu":  # --cuda-memory-fraction: this process's allocator takes at most that share of its GPU
            torch.cuda.set_per_process_memory_fraction(settings.cuda_memory_fraction, torch.device(device))
        self.tp = settings.num_shard
        if self.tp > 1:  # the replica's ranks rendezvous (a barrier) before loading their shards of the model
            if not settings.tp_port:
                raise RuntimeError("--num-shard > 1 needs SWITCHYARD_TP_PORT (set by the launcher)")
            port = settings.tp_port + replica - settings.replica_base  # the launcher's ports are this host's
            tensor_parallel.init_group(rank, self.tp, port, torch.device(device), run_dir=settings.run_dir)
            tensor_parallel.start_watchdog()
        try:
            # the launcher resolves --dtype; a shard started with "auto" (by hand, or another host's env) does the same
            self.dtype = cpu.choose_dtype(settings.dtype, cpu.checkpoint_dtype(settings.model_path), device).dtype
            self.runner = ModelRunner(
                settings.model_path,
                num_blocks=settings.num_blocks,
                block_size=BLOCK_SIZE,
                dtype=getattr(torch, self.dtype),
                device=device,
                watermark_gamma=settings.watermark_gamma,
                watermark_delta=settings.watermark_delta,
                lora_adapters=dict(entry.split("=", 1) for entry in settings.lora_adapters.split(",") if entry),
                max_loras=settings.max_loras,
                max_lora_rank=settings.max_lora_rank,
                lora_fold=settings.lora_fold,
                quantize=settings.quantize,
                grammar=not settings.disable_grammar_support,
                decoder_walk=settings.decoder_walk,
                cpu_kernels=settings.cpu_kernels,
                grammar_fill=settings.grammar_fill,
                kv_prefault=settings.kv_prefault,
                cuda_graphs=tuple(int(b) for b in settings.cuda_graphs.split(",") if b),  # on CUDA only
                compile=settings.compile,  # compiled before the shard answers the probe (inductor cache: compiled.py)
                compile_buckets=tuple(int(b) for b in settings.compile_buckets.split(",") if b),
            )
        except Exception:
            logging.getLogger(f"switchyard.{ROLE}").exception("cannot load the model from %s", settings.model_path)
            # no restart mends a model that does not load: say so in the run directory, where the launcher looks
            # (launcher/supervise.py), so the server stops now, not after supervisord's retries
            if settings.run_dir:
                with open(os.path.join(settings.run_dir, "cannot-load"), "a") as f:
                    f.write(f"{ROLE}\n")
            raise SystemExit(1) from None
        self.num_blocks = settings.num_blocks
        self.tuner: cpu_tuning.TeamTuner | None = None  # a CPU shard's team, set by main()

    def run(self, log) -> None:
        got_plan = False
        synced = self.tp == 1  # tensor parallel: run steps only from a probe on, as every other rank does
        while True:
            if not self.plans.poll(500):
                if not got_plan:  # keep knocking until the scheduler's probe reaches us
                    bus.send(self.results, ShardReady(rank=self.rank, pid=os.getpid(), num_blocks=self.num_blocks))
                continue
            plan = bus.recv(self.plans)
            if isinstance(plan, ShardAdapters):  # between two steps, at the same point on every rank
                self._sync_adapters(plan, log)
                continue
            if not isinstance(plan, StepPlan):
                continue
            if not got_plan and self.tp > 1:
                # Every rank hears plans now (its subscription is live): only then may rank 0 answer a probe,
                # so the scheduler's first step reaches all ranks and "ready" means every rank is loaded.
                tensor_parallel.barrier()
                log.info("all %d ranks of replica %d subscribed", self.tp, self.replica)
            got_plan = True
            if plan.step == 0:  # a (new) scheduler's probe: start from a clean slate
                self.runner.reset()
                synced = True
                result = StepResult(step=0, rank=self.rank)
            elif not synced:  # a step sent before the probe: other ranks may not have it, so no rank runs it
                continue
            else:
                try:
                    result = self.runner.execute(plan)
                    log.debug("step %d: %d rows, %d tokens, %d new; %.1f ms", plan.step, len(plan.seqs),
                              len(plan.token_ids), len(plan.new), 1000 * result.forward_s)  # fmt: skip
                except Exception as e:  # a failed step fails its requests, not the process
                    log.exception("step %d failed", plan.step)
                    result = StepResult(step=plan.step, rank=self.rank, error=f"{type(e).__name__}: {e}")
            if self.rank == 0:
                bus.send(self.results, result)
            if self.tuner is not None:  # between two steps: the team may be resized here
                self.tuner.between_steps()

    def _sync_adapters(self, msg: ShardAdapters, log) -> None:
        """Hold the scheduler's run-time adapter set; every rank answers, so the scheduler knows all of them did."""
        before = dict(self.runner.lora.sources)
        errors = self.runner.lora.sync(msg.adapters, msg.generations)
        for name, why in errors.items():
            log.warning("LoRA adapter %s not loaded: %s", name, why)
        if self.runner.lora.sources != before:  # the scheduler re-sends the set after every probe: log changes only
            log.info("LoRA adapters loaded: %s", ", ".join(self.runner.lora.loaded()) or "none")
        ack = ShardAdaptersAck(op=msg.op, rank=self.rank, errors=errors, loaded=self.runner.lora.loaded())
        bus.send(self.results, ack)


def main() -> None:
    def body(settings: Settings, log) -> None:
        heap.keep_for_reuse()  # a step's large tensors from the heap, not fresh mappings (libs/runtime/heap.py)
        # supervisord numbers the replicas × num_shard shard processes 0…; process i serves replica
        # i // num_shard as rank i % num_shard
        replica, rank = divmod(settings.index, max(1, settings.num_shard))
        # the OpenMP team: the host's usable cores shared by the shards it runs, less what others keep busy
        local = settings.index - settings.replica_base * max(1, settings.num_shard)  # among this host's shards
        tuner = cpu_tuning.TeamTuner(cpu_team.flags_from(settings), settings.procs_shard, local, log)
        tuner.start()
        shard = ShardService(settings, replica=replica, rank=rank)
        shard.tuner = tuner
        heap.release()  # what loading left free goes back: the kept heap holds only what serving needs
        log.info(
            "replica %d rank %d: model loaded from %s (%s on %s); %d KV blocks",
            replica,
            rank,
            settings.model_path,
            shard.dtype,
            shard.runner.device,
            settings.num_blocks,
        )
        if shard.runner.lora.adapters:
            log.info("LoRA adapters loaded: %s", ", ".join(shard.runner.lora.loaded()))
        shard.run(log)

    service.run(ROLE, body)


if __name__ == "__main__":
    main()
