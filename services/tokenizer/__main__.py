"""`python -m services.tokenizer`: validate as TGI does, tokenize, forward to admit."""

from __future__ import annotations

import os

# one process = one core's worth of tokenizing: the Rust pool would fight the shard for cores
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import zmq
from tokenizers import Tokenizer

from libs.protocol import Addresses, topics
from libs.protocol.messages import GenerateRequest, RequestError, TokenizedRequest
from libs.runtime import bus, service
from libs.runtime.settings import Settings
from services.tokenizer import validation

ROLE = "tokenizer"


class TokenizerService:
    def __init__(self, settings: Settings):
        self.settings = settings
        addresses = Addresses.parse(settings.bus)
        self.tokenizer = Tokenizer.from_file(os.path.join(settings.model_path, "tokenizer.json"))
        self.inbox = bus.socket(zmq.PULL, connect=addresses.tokenize)
        self.admit = bus.socket(zmq.PUSH, connect=addresses.admit)
        self.events = bus.EventBus(addresses, ROLE, settings.index, subscribe=[])
        self.handled = self.rejected = 0

    def handle(self, req: GenerateRequest) -> None:
        s = self.settings
        try:
            validation.check_parameters(
                req.parameters,
                inputs=req.inputs,
                max_stop_sequences=s.max_stop_sequences,
                max_input_tokens=s.max_input_tokens,
            )
            ids = self.tokenizer.encode(req.inputs, add_special_tokens=req.add_special_tokens).ids
            ids, max_new_tokens, sampling, seed = validation.resolve(
                req.parameters, ids, max_input_tokens=s.max_input_tokens, max_total_tokens=s.max_total_tokens
            )
        except validation.ValidationError as e:
            self.rejected += 1
            error = RequestError(request_id=req.request_id, message=e.full_message, error_type="validation")
            self.events.publish(topics.out(req.ingress), error)
            return
        self.handled += 1
        tokenized = TokenizedRequest(
            request_id=req.request_id,
            ingress=req.ingress,
            input_ids=np.asarray(ids, dtype=np.int32),
            sampling=sampling,
            max_new_tokens=max_new_tokens,
            stop=req.parameters.stop,
            seed=seed,
            received_at=req.received_at,
        )
        bus.send(self.admit, tokenized)

    def run(self) -> None:
        self.events.start()
        while True:
            if self.inbox.poll(500):
                msg = bus.recv(self.inbox)
                if isinstance(msg, GenerateRequest):
                    self.handle(msg)
            while self.events.sub.poll(0):
                self.events.recv()  # only our own heartbeats come back; drain them
            self.events.heartbeat(counters={"handled": self.handled, "rejected": self.rejected})


def main() -> None:
    def body(settings: Settings, log) -> None:
        tokenizer = TokenizerService(settings)
        log.info("tokenizer ready")
        tokenizer.run()

    service.run(ROLE, body)


if __name__ == "__main__":
    main()
