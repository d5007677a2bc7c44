"""--quantize: the method from the flag or config.json, and every refusal's message."""

from __future__ import annotations

import json
import logging

import pytest

from launcher import quantize
from launcher.quantize import QuantizeError, resolve


def _model(tmp_path, quantization_config=None, key="quantization_config"):
    config = {"model_type": "llama"}
    if quantization_config is not None:
        config[key] = quantization_config
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    "qc, method",
    [
        ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "gptq"),
        ({"quant_method": "awq", "bits": 4, "version": "gemm"}, "awq"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "compressed-tensors"),
        ({"quant_method": "fbgemm_fp8"}, "fp8"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "bitsandbytes-nf4"),
        ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "bitsandbytes"),
    ],
)
def test_the_method_is_read_from_config(tmp_path, qc, method):
    assert quantize.checkpoint_method(_model(tmp_path, qc)) == method
    if method.startswith("bitsandbytes"):
        with pytest.raises(QuantizeError, match=f"saved quantized by bitsandbytes .{method}. is not read here"):
            resolve(None, tmp_path, cuda=False)
    elif method not in quantize.CUDA_ONLY:
        assert resolve(None, tmp_path, cuda=False) == method
        assert resolve(method, tmp_path, cuda=False) == method


def test_compression_config_is_read_too(tmp_path):
    model = _model(tmp_path, {"quant_method": "compressed-tensors"}, key="compression_config")
    assert resolve(None, model, cuda=False) == "compressed-tensors"


def test_a_float_checkpoint_runs_unquantized_or_quantized_at_load(tmp_path):
    model = _model(tmp_path)
    assert resolve(None, model, cuda=False) is None
    for method in ("eetq", "bitsandbytes-nf4", "bitsandbytes-fp4"):
        assert resolve(method, model, cuda=False) == method


def test_bitsandbytes_8bit_warns_it_is_deprecated(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        assert resolve("bitsandbytes", _model(tmp_path), cuda=False) == "bitsandbytes"
    assert "deprecated" in caplog.text and "eetq" in caplog.text


@pytest.mark.parametrize("method", quantize.CUDA_ONLY)
def test_cuda_only_methods_exit_without_cuda(tmp_path, method):
    with pytest.raises(QuantizeError) as e:
        resolve(method, _model(tmp_path), cuda=False)
    assert f"--quantize {method} needs a CUDA GPU" in str(e.value) and "this machine has none" in str(e.value)
    assert "gptq" in str(e.value).split("run here:")[1]  # says what does run


def test_a_cuda_only_method_from_config_exits_too(tmp_path):
    with pytest.raises(QuantizeError, match="--quantize fp8 needs a CUDA GPU"):
        resolve(None, _model(tmp_path, {"quant_method": "fp8"}), cuda=False)


def test_a_cuda_machine_is_refused_until_gpu_kernels_exist(tmp_path):
    """The shard would run on the GPU, where the CPU kernels cannot follow: refuse rather than fake it."""
    for flag, qc in (("fp8", None), ("marlin", {"quant_method": "gptq"}), (None, {"quant_method": "awq"})):
        with pytest.raises(QuantizeError, match="on a machine with CUDA: Switchyard's quantized layers run on the CPU"):
            resolve(flag, _model(tmp_path, qc), cuda=True)
    assert resolve(None, _model(tmp_path), cuda=True) is None  # no quantization: nothing to refuse


@pytest.mark.parametrize(
    "flag, qc, found",
    [
        ("awq", {"quant_method": "gptq"}, "quant_method 'gptq'"),
        ("gptq", {"quant_method": "compressed-tensors"}, "quant_method 'compressed-tensors'"),
        ("eetq", {"quant_method": "awq"}, "quant_method 'awq'"),
        ("gptq", None, "no quantization_config (a float checkpoint)"),
        ("compressed-tensors", None, "no quantization_config"),
    ],
)
def test_a_mismatch_names_both_sides(tmp_path, flag, qc, found):
    model = _model(tmp_path, qc)
    with pytest.raises(QuantizeError) as e:
        resolve(flag, model, cuda=False)
    message = str(e.value)
    assert message.startswith(f"Quantization config mismatch: --quantize {flag}, but ")
    assert str(model / "config.json") in message and found in message


def test_unknown_values_are_refused(tmp_path):
    with pytest.raises(QuantizeError, match="'int3' is not a method; TGI's are: awq, compressed-tensors"):
        resolve("int3", _model(tmp_path), cuda=False)
    with pytest.raises(QuantizeError, match="unknown quantization_config.quant_method 'hqq'"):
        resolve(None, _model(tmp_path, {"quant_method": "hqq"}), cuda=False)


def test_what_runs_here():
    assert quantize.supported_here(cuda=True) == []
    here = quantize.supported_here(cuda=False)
    assert set(quantize.METHODS) - set(here) == set(quantize.CUDA_ONLY)
    text = quantize.help_text()
    assert all(m in text for m in here)


def test_serve_resolves_the_method_into_the_settings(tmp_path, monkeypatch):
    from launcher.cli import build_parser, settings_from

    monkeypatch.setattr(quantize, "_cuda_available", lambda: False)  # the same answer on a GPU machine

    def settings(*argv, qc=None):
        model = _model(tmp_path, qc)
        return settings_from(build_parser().parse_args(["serve", "--model-id", str(model), *argv]), model)

    assert settings().quantize == ""
    assert settings("--quantize", "eetq").quantize == "eetq"
    assert settings(qc={"quant_method": "gptq", "bits": 4}).quantize == "gptq"
    with pytest.raises(SystemExit, match="error: Quantization config mismatch: --quantize awq, but "):
        settings("--quantize", "awq", qc={"quant_method": "gptq"})
    with pytest.raises(SystemExit, match="error: --quantize marlin needs a CUDA GPU"):
        settings("--quantize", "marlin", qc={"quant_method": "gptq"})
    assert settings("--quantize", "eetq", "--num-shard", "2").quantize == "eetq"  # split per rank (test_quant_tp)
    with pytest.raises(SystemExit, match="error: --num-shard 2: this GPTQ checkpoint has desc_act"):
        settings("--num-shard", "2", qc={"quant_method": "gptq", "desc_act": True, "group_size": 32})


def test_info_reports_the_quantization():
    from tests.services.http.fakes import FakeIngress, client, run

    async def info(**settings):
        async with client(FakeIngress(), **settings) as c:
            return await (await c.get("/info")).json()

    assert run(info(quantize="gptq"))["quantization"] == "gptq"
    assert "quantization" not in run(info())  # left out when the weights are served as stored
