"""Logs: JSON lines that parse, request ids, escaped control characters, RUST_LOG-style levels."""

from __future__ import annotations

import io
import json
import logging

import pytest

from libs.runtime import logs


@pytest.fixture
def capture(monkeypatch):
    """setup() on a captured stderr; restores the root logger afterwards."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    stream = io.StringIO()
    real = logs.setup
    monkeypatch.setattr(logs, "setup", lambda *a, **kw: real(*a, **kw, stream=stream))
    yield stream
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    for name in ("switchyard", "switchyard.bus", "aiohttp"):
        logging.getLogger(name).setLevel(logging.NOTSET)


def test_json_lines(capture, monkeypatch):
    monkeypatch.setenv("LOG_LEVEL", "info")
    log = logs.setup("scheduler", 2, json_output=True)
    evil = "abc\n2030-01-01T00:00:00 INFO fake"
    log.info("admitted %s", evil, extra={"request_id": evil})
    log.info("no request here")
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        log.exception("step failed")
    out = capture.getvalue().splitlines()
    assert len(out) == 3  # one object per line, whatever the content
    first, second, third = map(json.loads, out)
    assert first["message"] == f"admitted {evil}" and first["request_id"] == evil
    assert first["level"] == "INFO" and first["service"] == "scheduler" and first["index"] == 2
    assert first["target"] == "switchyard.scheduler" and isinstance(first["pid"], int)
    assert first["timestamp"].endswith("Z") and "T" in first["timestamp"]
    assert "request_id" not in second
    assert third["level"] == "ERROR" and "ValueError: bad\nthing" in third["exception"]


def test_json_from_settings_env(capture, monkeypatch):
    monkeypatch.setenv("SWITCHYARD_JSON_OUTPUT", "True")
    logs.setup("http", 0).warning("hello")
    line = json.loads(capture.getvalue())
    assert line["level"] == "WARN" and line["message"] == "hello"


def test_text_escapes_control_characters(capture):
    log = logs.setup("http", 1, json_output=False)
    rid = "id\r\n2030-01-01T00:00:00.000 INFO http.0 switchyard.http: forged\x1b[31m"
    log.info("request %s done", rid, extra={"request_id": rid})
    try:
        raise RuntimeError("x\nINFO forged")
    except RuntimeError:
        log.exception("oops")
    out = capture.getvalue().splitlines()
    assert out[0].startswith("20") and " INFO http.1 switchyard.http: request id\\r\\n2030" in out[0]
    assert "\\x1b[31m" in out[0] and out[0].endswith("request_id=" + logs.escape(rid))
    assert " ERROR http.1 switchyard.http: oops" in out[1]
    assert all(line.startswith("    ") for line in out[2:])  # traceback lines can never pose as records
    assert len(out) > 3


@pytest.mark.parametrize(
    "spec, level, targets",
    [
        (None, logging.INFO, {}),
        ("", logging.INFO, {}),
        ("debug", logging.DEBUG, {}),
        ("WARN", logging.WARNING, {}),
        ("trace", logging.DEBUG, {}),
        ("error", logging.ERROR, {}),
        ("text_generation_router=debug,info", logging.INFO, {"switchyard": logging.DEBUG}),
        ("info,switchyard.bus=debug,aiohttp=error", logging.INFO, {"switchyard.bus": logging.DEBUG, "aiohttp": 40}),
        ("text_generation_launcher=off", logging.INFO, {"switchyard": logging.CRITICAL + 10}),
        ("nonsense,warn", logging.WARNING, {}),
    ],
)
def test_parse_level(spec, level, targets):
    assert logs.parse_level(spec) == (level, targets)


def test_levels_apply(capture, monkeypatch):
    monkeypatch.setenv("LOG_LEVEL", "warn,switchyard.bus=debug")
    log = logs.setup("router", 0, json_output=True)
    log.info("hidden")
    logging.getLogger("switchyard.bus").debug("shown")
    log.warning("shown too")
    assert [json.loads(line)["message"] for line in capture.getvalue().splitlines()] == ["shown", "shown too"]
