"""The machine in words (specray.runtime.hardware): what rows' manifests and bench reports record beside their times."""

from __future__ import annotations

import os

import pytest
import torch

from specray.runtime import hardware

TWO_PROCESSORS = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu avx2

processor\t: 1
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8480+
"""


@pytest.fixture
def cpuinfo(tmp_path, monkeypatch):
    """Point the module at a file of our own; the model is read once per process, so clear its cache."""
    path = tmp_path / "cpuinfo"
    monkeypatch.setattr(hardware, "CPUINFO", path)
    hardware.cpu_model.cache_clear()
    yield path
    hardware.cpu_model.cache_clear()


def test_the_first_processor_names_the_cpu_with_its_family_and_model(cpuinfo):
    cpuinfo.write_text(TWO_PROCESSORS)
    assert hardware.cpu_model() == "AMD EPYC 7B13 (family 25, model 1)"


def test_a_cpu_without_family_numbers_keeps_its_name_and_a_missing_file_says_unknown(cpuinfo):
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Neoverse-V2\n")
    assert hardware.cpu_model() == "Neoverse-V2"
    hardware.cpu_model.cache_clear()
    cpuinfo.unlink()
    assert hardware.cpu_model() == "unknown CPU"


def test_the_cpu_device_adds_the_vector_extensions_torch_uses_and_the_cpu_count(cpuinfo):
    cpuinfo.write_text(TWO_PROCESSORS)
    name = hardware.device_name("cpu")
    assert name == f"AMD EPYC 7B13 (family 25, model 1); {torch.backends.cpu.get_cpu_capability()}; {os.cpu_count()} CPUs"
    assert hardware.device_name(torch.device("cpu")) == name


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the name of a CUDA device that is not there")
def test_an_absent_gpu_is_named_without_initialising_cuda():
    assert hardware.device_name("cuda:0") == "cuda (unavailable)"
    assert not torch.cuda.is_initialized()


def test_a_gpu_that_fails_to_give_its_name_is_recorded_not_raised(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def broken(device):
        raise RuntimeError("CUDA error: unspecified launch failure")

    monkeypatch.setattr(torch.cuda, "get_device_name", broken)
    assert hardware.device_name("cuda:0") == "cuda (no name: CUDA error: unspecified launch failure)"
