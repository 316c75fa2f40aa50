"""`--dtype auto`: follows the checkpoint, bf16 only where the CPU has it natively, and says why."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from engine.dtype import cpu_flags, explain_dtype, native_bf16_flag
from engine.gguf.convert import _source_dtype

CPU, GPU = torch.device("cpu"), torch.device("cuda")
AMX = {"avx512f", "amx_tile", "amx_bf16"}
AVX2 = {"avx2", "fma"}


def cfg(stored):
    return SimpleNamespace(torch_dtype=stored)


@pytest.mark.parametrize(
    "stored,device,flags,expected",
    [
        ("bfloat16", CPU, AMX, torch.bfloat16),
        ("float16", CPU, {"avx512_bf16"}, torch.bfloat16),
        ("bfloat16", CPU, AVX2, torch.float32),
        ("float32", CPU, AMX, torch.float32),
        (None, CPU, AMX, torch.float32),
        (torch.bfloat16, CPU, {"fp", "asimd", "bf16"}, torch.bfloat16),  # aarch64, a torch dtype
        ("float16", GPU, set(), torch.float16),
        ("float32", GPU, set(), torch.bfloat16),
    ],
)
def test_auto_follows_the_checkpoint(stored, device, flags, expected):
    dtype, why = explain_dtype("auto", cfg(stored), device, flags)
    assert dtype == expected
    assert why.startswith("--dtype auto: the checkpoint stores")


def test_the_reason_names_the_flag_or_its_absence():
    assert "amx_bf16" in explain_dtype("auto", cfg("bfloat16"), CPU, AMX)[1]
    assert "no native bf16" in explain_dtype("auto", cfg("bfloat16"), CPU, AVX2)[1]


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_an_explicit_dtype_is_taken_as_given(name):
    for stored in ("bfloat16", "float32"):
        got = explain_dtype(name, cfg(stored), CPU, AVX2)
        assert got == (getattr(torch, name), f"--dtype {name}")


def test_cpu_flags_from_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_tile\n\nprocessor: 1\n")
    assert native_bf16_flag(cpu_flags(x86)) == "avx512_bf16"
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve\n")
    assert native_bf16_flag(cpu_flags(arm)) is None
    assert cpu_flags(tmp_path / "missing") == set()


@pytest.mark.parametrize("file_type,expected", [(0, "float32"), (1, "float16"), (32, "bfloat16"),
                                                (3, "bfloat16"), (None, "float32")])  # fmt: skip
def test_converted_gguf_declares_its_source_dtype(file_type, expected):
    meta = {} if file_type is None else {"general.file_type": file_type}
    assert _source_dtype(meta) == expected  # 3: Q4_1, the embedded default's file


def test_engine_serves_a_bf16_checkpoint_as_auto_resolves_and_logs_why(tmp_path, caplog):
    from engine import LLM
    from tests.conftest import build_tiny_model_dir

    path = build_tiny_model_dir(tmp_path / "bf16")
    config = json.loads((path / "config.json").read_text())
    config.pop("dtype", None)
    (path / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    expected = torch.bfloat16 if native_bf16_flag() else torch.float32
    with caplog.at_level(logging.INFO, logger="engine.dtype"):
        llm = LLM(str(path), max_model_len=64)
    assert llm.engine.runner.dtype == expected
    assert next(p.dtype for p in llm.engine.runner.model.parameters()) == expected
    line = f"dtype: {str(expected)[6:]} (--dtype auto: the checkpoint stores bfloat16"
    assert line in caplog.text
