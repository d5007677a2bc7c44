"""The Switchyard wire: messages, frame codec, addresses and topics. Pure: opens no sockets."""

from libs.protocol import topics
from libs.protocol.addresses import Addresses
from libs.protocol.codec import ProtocolError, decode, decode_pub, encode, encode_pub
from libs.protocol.messages import *  # noqa: F403

__all__ = ["Addresses", "ProtocolError", "decode", "decode_pub", "encode", "encode_pub", "topics"]
