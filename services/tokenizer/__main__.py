"""`python -m services.tokenizer`: render chat templates, validate as TGI does, tokenize, forward to admit."""

from __future__ import annotations

import os

# one process = one core's worth of tokenizing: the Rust pool would fight the shard for cores
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import zmq

from libs.protocol import Addresses, topics
from libs.protocol.messages import GenerateRequest, RequestError, TokenizedRequest
from libs.runtime import bus, service
from libs.runtime.settings import Settings
from services.tokenizer.processor import Processor

ROLE = "tokenizer"


class TokenizerService:
    def __init__(self, settings: Settings):
        self.settings = settings
        addresses = Addresses.parse(settings.bus)
        self.processor = Processor.from_settings(settings)
        self.inbox = bus.socket(zmq.PULL, connect=addresses.tokenize)
        self.admit = bus.socket(zmq.PUSH, connect=addresses.admit)
        self.events = bus.EventBus(addresses, ROLE, settings.index, subscribe=[])
        self.handled = self.rejected = self.tokenized = 0

    def handle(self, req: GenerateRequest) -> None:
        result = self.processor.process(req)
        if isinstance(result, TokenizedRequest):
            self.handled += 1
            bus.send(self.admit, result)
            return
        # a TokenizeResult or a RequestError: either ends the request, on its http process's topic
        if isinstance(result, RequestError):
            self.rejected += 1
        else:
            self.tokenized += 1
        self.events.publish(topics.out(req.ingress), result)

    def run(self) -> None:
        self.events.start()
        while True:
            if self.inbox.poll(500):
                msg = bus.recv(self.inbox)
                if isinstance(msg, GenerateRequest):
                    self.handle(msg)
            while self.events.sub.poll(0):
                self.events.recv()  # only our own heartbeats come back; drain them
            self.events.heartbeat(
                counters={"handled": self.handled, "rejected": self.rejected, "tokenized": self.tokenized}
            )


def main() -> None:
    def body(settings: Settings, log) -> None:
        tokenizer = TokenizerService(settings)
        log.info("tokenizer ready")
        tokenizer.run()

    service.run(ROLE, body)


if __name__ == "__main__":
    main()
