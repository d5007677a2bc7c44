"""Launcher flags: TGI names, environment fallbacks, derived limits and their checks."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.cli import build_parser, settings_from
from launcher.serve_settings import parse_cuda_graphs
from libs.runtime import cpu
from libs.runtime.settings import Settings
from tests.launcher.serve_argv import parse

ROOT = Path(__file__).resolve().parents[2]


def test_env_fallbacks(monkeypatch, model_dir):
    monkeypatch.setenv("MODEL_ID", str(model_dir))
    monkeypatch.setenv("PORT", "8081")
    monkeypatch.setenv("MAX_TOTAL_TOKENS", "1000")
    args = parse()
    assert (args.model_id, args.port) == (str(model_dir), 8081)
    s = settings_from(args, model_dir)
    assert (s.max_total_tokens, s.max_input_tokens) == (1000, 999)
    assert parse("--port", "9000").port == 9000  # a flag beats its variable


def test_derived_defaults(model_dir):
    s = settings_from(parse(), model_dir)
    assert s.max_total_tokens == 2048  # min(4096, max_position_embeddings)
    assert s.max_batch_prefill_tokens == 4096 and s.max_batch_total_tokens == 65536
    assert s.num_blocks == 65536 // 16
    assert (
        s.prefill_saturation_tokens == 512
        and settings_from(parse("--prefill-saturation-tokens", "0"), model_dir).prefill_saturation_tokens == 0
    )


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--max-input-tokens", "100", "--max-total-tokens", "100"], "must be < max_total_tokens"),
        (["--max-input-tokens", "10", "--max-input-length", "10"], "the same flag"),
        (["--max-input-tokens", "900", "--max-batch-prefill-tokens", "100"], "max_batch_prefill_tokens"),
        (["--max-total-tokens", "1000", "--max-batch-total-tokens", "500"], "max_batch_total_tokens"),
        (["--num-shard", "0"], "num-shard"),
        (["--prefill-saturation-tokens", "-1"], "prefill-saturation-tokens must be >= 0"),
        (["--num-shard", "2", "--sharded", "false"], "incompatible"),
    ],
)
def test_inconsistent_limits_are_refused(model_dir, argv, fragment):
    with pytest.raises(SystemExit, match=fragment):
        settings_from(parse(*argv), model_dir)


def test_hostname_that_is_not_an_address_falls_back(model_dir):
    assert settings_from(parse("--hostname", "my-container"), model_dir).hostname == "0.0.0.0"
    assert settings_from(parse("--hostname", "::1"), model_dir).hostname == "::1"


def test_settings_travel_through_the_environment():
    s = Settings(bus="ipc:///tmp/x", model_path="/m", port=1234, max_batch_size=7)
    assert Settings.from_env(s.to_env()) == s


def test_switches_go_on_from_the_launchers_environment(monkeypatch, model_dir):
    """The fields with no flag (Settings.SWITCHES) reach every service as set where `switchyard serve` ran."""
    assert settings_from(parse(), model_dir).decoder_walk  # unset: the defaults
    assert settings_from(parse(), model_dir).cpu_kernels
    assert settings_from(parse(), model_dir).kv_prefault
    for name, value in {
        "DECODER_WALK": "0",
        "GRAMMAR_FILL": "inline",
        "KV_PREFAULT": "0",
        "TORCH_THREADS": "3",
        "CPU_KERNELS": "0",
    }.items():
        monkeypatch.setenv(f"SWITCHYARD_{name}", value)
    s = settings_from(parse(), model_dir)
    assert (s.decoder_walk, s.grammar_fill, s.kv_prefault, s.torch_threads) == (False, "inline", False, 3)
    assert s.cpu_kernels is False
    assert Settings.from_env(s.to_env()) == s
    monkeypatch.setenv("SWITCHYARD_TORCH_THREADS", "many")
    with pytest.raises(SystemExit, match="SWITCHYARD_"):
        settings_from(parse(), model_dir)


def test_api_flags_defaults(model_dir):
    s = settings_from(parse(), model_dir)
    assert (s.max_top_n_tokens, s.payload_limit, s.validation_workers) == (5, 2_000_000, 2)
    assert (s.api_key, s.cors_allow_origin, s.chat_template, s.otlp_endpoint) == ("", "", "", "")
    assert (s.watermark_gamma, s.watermark_delta) == (0.5, 2.0)
    assert not s.disable_grammar_support and not s.json_output
    assert s.otlp_service_name == "text-generation-inference.router"


def test_api_flags_parse_into_settings(model_dir):
    argv = [
        *("--max-top-n-tokens", "3", "--payload-limit", "1000", "--api-key", "sekret"),
        *("--cors-allow-origin", "https://a.example", "--cors-allow-origin", "https://b.example"),
        *("--watermark-gamma", "0.25", "--watermark-delta", "1.5", "--validation-workers", "3"),
        *("--disable-grammar-support", "--json-output", "--enable-prefill-logprobs"),
        *("--otlp-endpoint", "http://otel:4317", "--otlp-service-name", "sy"),
        *("--chat-template", "{{ messages[0]['content'] }}"),
    ]
    s = settings_from(parse(*argv), model_dir)
    assert (s.max_top_n_tokens, s.payload_limit, s.api_key, s.validation_workers) == (3, 1000, "sekret", 3)
    assert s.cors_allow_origin == "https://a.example,https://b.example"
    assert (s.watermark_gamma, s.watermark_delta) == (0.25, 1.5)
    assert s.disable_grammar_support and s.json_output
    assert (s.otlp_endpoint, s.otlp_service_name) == ("http://otel:4317", "sy")
    assert s.chat_template == "{{ messages[0]['content'] }}"
    assert Settings.from_env(s.to_env()) == s  # every new field survives the trip to the services


def test_api_flags_env_fallbacks(monkeypatch, model_dir):
    for name, value in {
        "MAX_TOP_N_TOKENS": "7",
        "PAYLOAD_LIMIT": "42",
        "API_KEY": "k",
        "CORS_ALLOW_ORIGIN": "https://a.example, https://b.example",
        "WATERMARK_GAMMA": "0.1",
        "WATERMARK_DELTA": "4",
        "DISABLE_GRAMMAR_SUPPORT": "true",
        "JSON_OUTPUT": "1",
        "OTLP_ENDPOINT": "http://otel:4317",
        "OTLP_SERVICE_NAME": "svc",
        "VALIDATION_WORKERS": "4",
    }.items():
        monkeypatch.setenv(name, value)
    s = settings_from(parse(), model_dir)
    assert (s.max_top_n_tokens, s.payload_limit, s.api_key, s.validation_workers) == (7, 42, "k", 4)
    assert s.cors_allow_origin == "https://a.example,https://b.example"
    assert (s.watermark_gamma, s.watermark_delta) == (0.1, 4.0)
    assert s.disable_grammar_support and s.json_output
    assert (s.otlp_endpoint, s.otlp_service_name) == ("http://otel:4317", "svc")
    assert settings_from(parse("--cors-allow-origin", "https://c.example"), model_dir).cors_allow_origin == (
        "https://c.example"
    )  # the flag beats the variable
    monkeypatch.setenv("JSON_OUTPUT", "false")  # clap's falsey values switch a flag off
    assert not settings_from(parse(), model_dir).json_output


def test_chat_template_from_a_file(tmp_path, model_dir):
    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    s = settings_from(parse("--chat-template", str(path)), model_dir)
    assert s.chat_template == path.read_text()
    with pytest.raises(SystemExit, match="no such file"):
        settings_from(parse("--chat-template", str(tmp_path / "missing.jinja")), model_dir)


def test_compatibility_flags_are_accepted_and_ignored(model_dir, caplog):
    argv = [
        *("--trust-remote-code", "--max-waiting-tokens", "10"),
        *("--waiting-served-ratio", "1.2", "--sharded", "false"),
        *("--disable-custom-kernels", "--prometheus-port", "9001", "--usage-stats", "off"),
        *("--kv-cache-dtype", "fp8_e5m2"),
    ]
    with caplog.at_level("WARNING", logger="switchyard.launcher"):
        s = settings_from(parse(*argv), model_dir)
    assert s == settings_from(parse(), model_dir)  # nothing changed
    assert "--trust-remote-code is accepted for compatibility and ignored" in caplog.text
    with pytest.raises(SystemExit, match="needs --num-shard > 1"):
        settings_from(parse("--sharded", "true"), model_dir)
    with pytest.raises(SystemExit):
        parse("--sharded", "maybe")
    with pytest.raises(SystemExit, match="must be > 0"):
        settings_from(parse("--validation-workers", "0"), model_dir)
    helps = {a.dest: a.help for a in build_parser()._subparsers._group_actions[0].choices["serve"]._actions}
    assert "gptq" in helps["quantize"] and "always computed" in helps["enable_prefill_logprobs"]


def test_parse_cuda_graphs_as_tgi():
    assert parse_cuda_graphs(None) == (1, 2, 4, 8, 16, 32)
    assert parse_cuda_graphs("0") == ()
    assert parse_cuda_graphs("8,1, 2,2,0,256") == (1, 2, 8, 256)
    assert parse_cuda_graphs("") == ()
    for bad in ("1,x", "-1", "2.5"):
        with pytest.raises(ValueError):
            parse_cuda_graphs(bad)


def test_cuda_flags_are_settings(model_dir, monkeypatch, caplog):
    """--cuda-graphs as TGI reads it (comma list, zeros dropped, "0" disables, unset: 1..32) and
    --cuda-memory-fraction in (0, 1]: settings of the CUDA shards, never warned about."""
    with caplog.at_level("WARNING", logger="switchyard.launcher"):
        s = settings_from(parse("--cuda-graphs", "8,1,2,0", "--cuda-memory-fraction", "0.8"), model_dir)
    assert (s.cuda_graphs, s.cuda_memory_fraction) == ("1,2,8", 0.8)
    assert "cuda" not in caplog.text
    default = settings_from(parse(), model_dir)
    assert (default.cuda_graphs, default.cuda_memory_fraction) == ("1,2,4,8,16,32", 1.0)
    assert settings_from(parse("--cuda-graphs", "0"), model_dir).cuda_graphs == ""
    monkeypatch.setenv("CUDA_GRAPHS", "4,16")
    assert settings_from(parse(), model_dir).cuda_graphs == "4,16"
    for bad in (("--cuda-graphs", "1,x"), ("--cuda-memory-fraction", "0"), ("--cuda-memory-fraction", "1.5")):
        with pytest.raises(SystemExit):
            settings_from(parse(*bad), model_dir)


def test_dtype_is_chosen_once_by_the_launcher_and_logged(tmp_path, caplog):
    import logging

    from launcher.serve_settings import resolve_dtype
    from libs.runtime import cpu

    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32"}))
    with caplog.at_level(logging.INFO, logger="switchyard.launcher"):
        got = resolve_dtype("auto", tmp_path)
    assert got == cpu.choose_dtype("auto", "float32", "cpu").dtype  # this machine's rule (no GPU here)
    assert any(r.getMessage().startswith(f"dtype {got}: ") for r in caplog.records)
    assert resolve_dtype("float32", tmp_path) == "float32"
    with pytest.raises(SystemExit, match="--dtype must be one of"):
        resolve_dtype("float64", tmp_path)


def test_speculate_acts(model_dir, monkeypatch, caplog):
    with caplog.at_level("WARNING", logger="switchyard.launcher"):
        assert settings_from(parse("--speculate", "3"), model_dir).speculate == 3
    assert "speculate" not in caplog.text  # no longer ignored
    assert settings_from(parse(), model_dir).speculate == 0  # TGI's default: none
    monkeypatch.setenv("SPECULATE", "2")  # TGI's variable
    assert settings_from(parse(), model_dir).speculate == 2
    with pytest.raises(SystemExit, match="--speculate must be >= 0"):
        settings_from(parse("--speculate", "-1"), model_dir)
    assert settings_from(parse(), model_dir).speculate_policy == "adaptive"
    assert settings_from(parse("--speculate-policy", "always"), model_dir).speculate_policy == "always"
    monkeypatch.setenv("SPECULATE_POLICY", "sometimes")  # argparse does not check a default against its choices
    with pytest.raises(SystemExit, match="--speculate-policy must be adaptive or always"):
        settings_from(parse(), model_dir)


def test_image_nice(model_dir, monkeypatch):
    assert settings_from(parse(), model_dir).image_nice == 19
    assert settings_from(parse("--image-nice", "5"), model_dir).image_nice == 5
    monkeypatch.setenv("IMAGE_NICE", "0")
    assert settings_from(parse(), model_dir).image_nice == 0
    for bad in ("-1", "20"):
        with pytest.raises(SystemExit, match="--image-nice must be a nice value from 0 to 19"):
            settings_from(parse("--image-nice", bad), model_dir)


def test_settings_come_without_torch_on_a_cpu_build(model_dir):
    """On a CPU-only torch build the launcher derives every setting, the dtype included, without importing torch or
    transformers (seconds of each start, before any service starts)."""
    code = (
        "import sys\n"
        "from launcher.cli import build_parser, settings_from\n"
        f"s = settings_from(build_parser().parse_args(['serve', '--model-id', {str(model_dir)!r}]), "
        f"__import__('pathlib').Path({str(model_dir)!r}))\n"
        "print(s.dtype, 'torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    dtype, torch_imported, transformers_imported = out.stdout.split()
    assert dtype in ("float32", "bfloat16")
    assert transformers_imported == "False"
    assert torch_imported == str(not cpu.torch_cpu_build())
