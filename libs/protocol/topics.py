"""Event-bus topics. Ids are fixed-width so one topic never prefix-matches another."""

from __future__ import annotations

OUT = b"out."  # what one http process must hear about its requests
TOK = b"tok."  # token batches for one detokenizer shard
CTL = b"ctl."  # aborts and stop-sequence hits for one scheduler (replica)
HB = b"hb."  # heartbeats: hb.<role>.<n>
LORA = b"lora."  # the LoRA adapters a replica serves now (libs.protocol.lora.AdapterSet)
TOKENIZE = b"tokenize."  # a request for a named model (not the default), to one tokenizer of that model


def _id(n: int) -> bytes:
    if not 0 <= n <= 9999:
        raise ValueError(f"topic id out of range: {n}")
    return b"%04d" % n


def out(ingress: int) -> bytes:
    return OUT + _id(ingress)


def tok(detokenizer: int) -> bytes:
    return TOK + _id(detokenizer)


def ctl(replica: int) -> bytes:
    return CTL + _id(replica)


def hb(role: str, index: int) -> bytes:
    return HB + role.encode() + b"." + _id(index)


def lora(replica: int) -> bytes:
    return LORA + _id(replica)


def tokenize(tokenizer: int) -> bytes:
    return TOKENIZE + _id(tokenizer)
