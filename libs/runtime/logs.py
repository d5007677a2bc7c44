"""Logging for every process: plain text lines, or one JSON object per line (`--json-output`).

`setup(role, index)` once at start returns `switchyard.<role>`; a record names its request with
`extra={"request_id": rid}`. JSON lines (SWITCHYARD_JSON_OUTPUT=true) carry timestamp (UTC, RFC 3339), level (TGI's
spelling: TRACE/DEBUG/INFO/WARN/ERROR), service (the role), index, pid, target (the logger), message, request_id
when the record has one, and "exception" (the traceback, in the string) when there is one. Plain text is one line
per record too: control characters in messages and request ids (which a client may choose) are escaped and
traceback lines indented, so no client input can start a line that looks like a record of its own. The level comes
from LOG_LEVEL (else RUST_LOG) in RUST_LOG's syntax, as TGI's launcher reads it: a bare level sets the global
level, `target=level` one logger (TGI's text_generation_* targets name our `switchyard` loggers); unknown words
are ignored, and the default is info.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import sys

from libs.runtime.settings import Settings

_LEVELS = {
    "trace": logging.DEBUG,  # Python has no TRACE; debug is the closest
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "off": logging.CRITICAL + 10,
}
_NAMES = {logging.DEBUG: "DEBUG", logging.INFO: "INFO", logging.WARNING: "WARN", logging.ERROR: "ERROR"}
_CONTROL = re.compile(r"[\x00-\x1f\x7f\u2028\u2029\x85]")


def escape(text: str) -> str:
    """`text` with control characters (newlines included) as visible escapes: one line, always."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def parse_level(spec: str | None) -> tuple[int, dict[str, int]]:
    """(global level, {logger name: level}) from a RUST_LOG-style string."""
    level, targets = logging.INFO, {}
    for directive in (spec or "").split(","):
        directive = directive.strip().lower()
        if not directive:
            continue
        target, sep, name = directive.rpartition("=")
        if name not in _LEVELS:
            continue
        if not sep:
            level = _LEVELS[name]
        elif target.startswith("text_generation"):
            targets["switchyard"] = _LEVELS[name]
        elif target:
            targets[target.replace("::", ".")] = _LEVELS[name]
    return level, targets


class JsonFormatter(logging.Formatter):
    def __init__(self, role: str, index: int):
        super().__init__()
        self.role, self.index, self.pid = role, index, os.getpid()

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        obj = {
            "timestamp": ts.isoformat(timespec="microseconds").replace("+00:00", "Z"),
            "level": _NAMES.get(record.levelno, record.levelname),
            "service": self.role,
            "index": self.index,
            "pid": self.pid,
            "target": record.name,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid is not None:
            obj["request_id"] = str(rid)
        if record.exc_info:
            obj["exception"] = self.formatException(record.exc_info)
        # json.dumps escapes every control character, so a record is exactly one line
        return json.dumps(obj, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self, role: str, index: int):
        super().__init__(datefmt="%Y-%m-%dT%H:%M:%S")
        self.tag = f"{role}.{index}"

    def format(self, record: logging.LogRecord) -> str:
        line = (
            f"{self.formatTime(record, self.datefmt)}.{int(record.msecs):03d} "
            f"{_NAMES.get(record.levelno, record.levelname)} {self.tag} {record.name}: {escape(record.getMessage())}"
        )
        rid = getattr(record, "request_id", None)
        if rid is not None:
            line += f" request_id={escape(str(rid))}"
        if record.exc_info:
            tb = self.formatException(record.exc_info)
            line += "".join("\n    " + escape(part) for part in tb.splitlines())
        return line


def setup(role: str, index: int, json_output: bool | None = None, stream=None) -> logging.Logger:
    """Configure the root logger for this process (to `stream`, default stderr) and return
    `switchyard.<role>`. `json_output` None reads Settings (SWITCHYARD_JSON_OUTPUT) from the environment."""
    if json_output is None:
        json_output = Settings.from_env().json_output
    level, targets = parse_level(os.environ.get("LOG_LEVEL") or os.environ.get("RUST_LOG"))
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter(role, index) if json_output else TextFormatter(role, index))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    for name, lvl in targets.items():
        logging.getLogger(name).setLevel(lvl)
    return logging.getLogger(f"switchyard.{role}")
