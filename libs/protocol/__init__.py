"""The Switchyard wire: messages, frame codec, addresses and topics. Pure: opens no sockets.

Each name lives in one module and is imported from there (`libs.protocol.messages`, `.step_messages`, `.lora`,
`.params`, `.message_base`); the package itself offers only what nearly every process needs to reach the bus."""

from libs.protocol import codec, topics
from libs.protocol.addresses import Addresses
from libs.protocol.codec import ProtocolError

__all__ = ["Addresses", "ProtocolError", "codec", "topics"]
