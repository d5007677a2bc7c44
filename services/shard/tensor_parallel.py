"""Tensor parallelism: one process group per replica, its ranks on one host, rank 0's TCPStore as rendezvous.

Each replica's `num_shard` shard processes form their own torch.distributed world (gloo on CPU, NCCL on CUDA)
whose rank 0 listens on 127.0.0.1:`tp_port + replica` (the launcher picks free ports). transformers shards the
model by its own `base_model_tp_plan` (column-parallel q/k/v/gate/up, row-parallel o/down with an all-reduce),
so the attention function sees heads / num_shard local heads and each rank's KV cache holds its share of the KV
heads; the LM head's logits come out whole on every rank. A group cannot lose a member and go on: every rank
watches its peers' counters in the store (`start_watchdog`) and exits when one stops, so the whole replica
restarts; collectives carry a timeout. docs/recovery.md tells why.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time

import torch
import torch.distributed as dist

from libs.runtime.timeouts import HEARTBEAT_S
from libs.runtime.timeouts import TP_PEER_STALE_S as STALE_S

log = logging.getLogger(__name__)


def init_group(
    rank: int, world: int, port: int, device: torch.device, run_dir: str = "", timeout_s: float = 120.0
) -> None:
    """Join this replica's group (blocks until every rank has joined: the rendezvous is a barrier). `run_dir`: the
    server's run directory (Settings.run_dir), where rank 0 marks that its group formed ("": no mark)."""
    if dist.is_initialized():
        return
    # rank 0 leaves a mark in the run directory once its group formed: a later rank that finds it was restarted
    formed = os.path.join(run_dir, f"tp-group-{port}") if run_dir else None
    if rank > 0 and (formed is None or os.path.exists(formed)):
        # a restarted peer waits out the old rank 0, which exits once it sees us silent: rendezvous with a
        # group that is going away would only fail later (a first start has no old group to wait out)
        time.sleep(STALE_S + HEARTBEAT_S)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # a timed-out collective ends the process
    # transformers binds its TP device from LOCAL_RANK
    os.environ["LOCAL_RANK"] = str(device.index or 0)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kwargs,
    )
    if rank == 0 and formed is not None:
        open(formed, "w").close()


def start_watchdog(on_lost=None) -> threading.Thread:
    """Exit the process when a peer stops beating (or the store, i.e. rank 0, is gone)."""
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()

    def exit_process(why: str) -> None:
        log.error("tensor parallel group broken: %s; exiting so the replica's ranks restart together", why)
        os._exit(1)

    on_lost = on_lost or exit_process

    def watch() -> None:
        seen = {peer: (-1, time.monotonic()) for peer in range(world) if peer != rank}
        while True:
            try:
                store.add(f"switchyard/beat/{rank}", 1)
                for peer, (count, since) in seen.items():
                    now = store.add(f"switchyard/beat/{peer}", 0)
                    if now != count:
                        seen[peer] = (now, time.monotonic())
                    elif time.monotonic() - since > STALE_S:
                        return on_lost(f"rank {peer} silent for {STALE_S:.0f}s")
            except Exception as e:  # the store lives in rank 0: it is gone
                return on_lost(f"lost the group's store ({type(e).__name__}: {e})")
            time.sleep(HEARTBEAT_S)

    thread = threading.Thread(target=watch, name="tp-watchdog", daemon=True)
    thread.start()
    return thread


def barrier() -> None:
    """Every rank of the group has reached this point (no-op without a group)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def tp_split(module: torch.nn.Linear) -> tuple[str | None, int, int]:
    """How `module` is sharded over the tensor-parallel group: ("col" | "row" | None, offset, local size) of the
    sharded dimension (outputs for "col", inputs for "row"), read from its local weight's shape."""
    weight = module.weight
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    out_local, in_local = local.shape
    if out_local == module.out_features and in_local == module.in_features:
        return None, 0, 0
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    # DTensor's Shard placement: chunks of ceil(n / world), the last one possibly shorter
    if out_local != module.out_features:
        return "col", rank * -(-module.out_features // world), out_local
    return "row", rank * -(-module.in_features // world), in_local
