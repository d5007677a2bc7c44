"""Client authentication on the CURVE bus: a ZAP handler that lets in only the listed client keys.

A binding process (router, scheduler) given an allowed-keys file (--bus-curve-allowed-keys) runs pyzmq's
ThreadAuthenticator on its context before it binds, so every CURVE handshake on its server sockets is asked
here first. A client whose public key is neither in the file nor the deployment's own (the binders connect to
each other with it) fails the handshake: no message of it passes, so it places no request, reads no stream and
attaches no tap. The file is re-read when it changes, so keys rotate without a restart: list the new keys
beside the old, move the clients over, drop the old. A refused key is logged once, by its fingerprint.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading

import zmq
import zmq.auth.thread
from zmq.utils import z85

log = logging.getLogger("switchyard.bus")


def is_key(text: str) -> bool:
    from libs.runtime.bus import is_key as z85_key  # one definition of a key's text

    return z85_key(text)


def fingerprint(public: str) -> str:
    """A short name of a public key for logs and for matching a key list by eye: the first 16 hex digits of the
    SHA-256 of its 32 bytes (`switchyard keygen --client` prints it too)."""
    return hashlib.sha256(z85.decode(public.encode())).hexdigest()[:16]


def parse_keys(text: str, source: str) -> set[str]:
    """The public keys of an allowed-keys file: one a line, the line's first word (a bare key, or keygen's
    `NAME='key'` line); blank lines and `# ` comments skipped, and words after the key are a comment too. A line
    that holds no public key is an error naming its line, never its text (it may be a secret pasted by mistake)."""
    keys = set()
    for n, line in enumerate(text.splitlines(), 1):
        words = line.strip().removeprefix("export ").split()
        if not words:
            continue
        word = words[0]
        name, eq, value = word.partition("=")  # Z85 uses `=`: a whole word that is a key is taken first
        if not is_key(word) and eq and name.isidentifier():
            if "SECRET" in name.upper():
                raise ValueError(f"{source} line {n} names a secret key: list only public keys")
            word = value.strip("'\"")
        if is_key(word):
            keys.add(word)
        elif not line.lstrip().startswith("#"):
            raise ValueError(f"{source} line {n}: not a 40-character Z85 public key, nor a `# ` comment")
    return keys


def read_keys(path: str) -> set[str]:
    """parse_keys of the file at `path`; OSError and ValueError say what is wrong."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return parse_keys(f.read(), path)


class AllowedKeys:
    """The ZAP credentials provider: a client key is let in if the file lists it (re-read whenever its size,
    mtime or inode change: a Kubernetes Secret is updated by swapping a link) or it is the deployment's own."""

    def __init__(self, path: str, own_public: str):
        self.path, self.own = path, own_public
        self._lock = threading.Lock()
        self._stamp: tuple | None = None
        self.keys: set[str] = set()
        self._refused: set[str] = set()  # fingerprints already logged
        self._reload()
        if self._stamp is None:
            raise ValueError(f"the allowed client keys file {path} cannot be read")

    def _reload(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError as e:
            if self._stamp is not None:
                log.error("allowed client keys %s: %s; keeping the %d keys read before", self.path, e, len(self.keys))
                self._stamp = ()  # logged once until the file is back
            return
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp == self._stamp:
            return
        try:
            keys = read_keys(self.path)
        except (OSError, ValueError) as e:
            log.error("allowed client keys: %s; keeping the %d keys read before", e, len(self.keys))
        else:
            if self._stamp is not None:
                log.info("allowed client keys re-read from %s: %d keys", self.path, len(keys))
            self.keys = keys
            self._refused.clear()  # a key refused before may be listed now, or refused again: say so again
        self._stamp = stamp

    def callback(self, domain: str, key: bytes) -> bool:
        public = key.decode() if isinstance(key, bytes) else key
        with self._lock:
            self._reload()
            if public in self.keys or public == self.own:
                return True
            fp = fingerprint(public)
            if fp not in self._refused:
                self._refused.add(fp)
                log.warning("refused a bus client: its key (fingerprint %s) is not in %s", fp, self.path)
            return False


_authenticators: dict[int, zmq.auth.thread.ThreadAuthenticator] = {}  # id(context) → its ZAP handler
_start_lock = threading.Lock()


def require_listed_clients(ctx: zmq.Context, path: str, own_public: str) -> None:
    """Start the ZAP handler of `ctx` (once): its CURVE server sockets then accept only the keys `path` lists
    and `own_public`. Must run before those sockets bind."""
    with _start_lock:
        if id(ctx) in _authenticators:
            return
        allowed = AllowedKeys(path, own_public)  # read first: a file that cannot be read starts nothing
        quiet = logging.getLogger("switchyard.bus.zap")  # pyzmq logs every handshake at debug
        quiet.setLevel(logging.WARNING)
        auth = zmq.auth.thread.ThreadAuthenticator(ctx, log=quiet)
        auth.start()
        auth.configure_curve_callback("*", allowed)
        _authenticators[id(ctx)] = auth


def release(ctx: zmq.Context) -> None:
    """Stop the ZAP handler of `ctx`, if it has one (before the context is destroyed)."""
    with _start_lock:
        auth = _authenticators.pop(id(ctx), None)
    if auth is not None:
        auth.stop()
