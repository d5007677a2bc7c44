"""The life of a service process: settings from the environment, logging, metrics, tracing, a clean stop."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

from libs.runtime import bus, cpu_team, logs, metrics, tracing
from libs.runtime.settings import Settings


def global_index(role: str, settings: Settings) -> Settings:
    """`settings` with its index made global: supervisord (or a StatefulSet's ordinal) counts from 0 on every host,
    and --replica-base / --worker-base (SWITCHYARD_REPLICA_BASE, SWITCHYARD_WORKER_BASE) move a host's replicas, or
    its tokenizers and detokenizers, after the others'."""
    if settings.replica_base and role in ("scheduler", "shard"):
        per_replica = max(1, settings.num_shard) if role == "shard" else 1
        settings = settings.replace(index=settings.index + settings.replica_base * per_replica)
    if settings.worker_base and role in ("tokenizer", "detokenizer"):
        settings = settings.replace(index=settings.index + settings.worker_base)
    return settings


def run(role: str, body: Callable[[Settings, logging.Logger], None]) -> None:
    """Run `body` until SIGTERM (supervisord's stop) or Ctrl-C, then close every socket at once.

    Before `body`: logging (`logs.setup`), this process's metrics registry (`metrics.init`, read
    back anywhere with `metrics.get()`; the heartbeat carries it), tracing (`tracing.init`, off
    without --otlp-endpoint) and the bus key (`bus.configure`: CURVE on every tcp socket when set)."""
    settings = global_index(role, Settings.from_env())
    log = logs.setup(role, settings.index, settings.json_output)
    if bus.configure(settings) is not None and settings.bus.startswith("tcp://"):
        log.info("bus links encrypted (CURVE)")
    metrics.init(role, settings.index, settings)
    if role != "shard":  # the shard sets its own cores (services/shard/cpu_tuning.py)
        cpu_team.pin_helper(settings, log)
    tracing.init(settings.otlp_service_name, settings.otlp_endpoint, role=role, index=str(settings.index))
    bus.exit_on_sigterm()
    try:
        body(settings, log)
    except KeyboardInterrupt:
        pass
    finally:
        bus.say_goodbye()
        tracing.shutdown()
        bus.context().destroy(linger=0)
    # A clean stop has nothing left to do: skip the interpreter's teardown, which takes seconds once torch and
    # transformers are loaded (the shard) and which supervisord's stopwaitsecs would cut short with SIGKILL.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
