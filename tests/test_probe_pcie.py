"""offload-probe's PCIe ceiling reads the link of the right GPU (schedule/probe_cli.py).

NVML numbers all GPUs of the machine in PCI order; torch numbers the visible ones. Under
CUDA_VISIBLE_DEVICES=2,3 torch's cuda:0 is NVML's device 2: the ceiling must come from
the device with cuda:0's PCI bus id. A stand-in NVML module and stand-in device properties
play the machine.
"""
from __future__ import annotations

import sys
import types

import pytest
import torch

from offload.schedule import probe_cli

# NVML's view of the machine: bus id -> (index, current gen, width, max gen, max width)
_MACHINE = {
    "0000:1a:00.0": (0, 4, 8, 4, 16),
    "0000:3b:00.0": (1, 4, 8, 4, 16),
    "0000:5e:00.0": (2, 5, 16, 5, 16),
    "0000:86:00.0": (3, 3, 4, 5, 16),
}


def _fake_nvml():
    by_index = {v[0]: k for k, v in _MACHINE.items()}
    nvml = types.ModuleType("pynvml")
    nvml.calls = []
    nvml.nvmlInit = lambda: nvml.calls.append("init")
    nvml.nvmlShutdown = lambda: nvml.calls.append("shutdown")

    def by_bus_id(bus_id):
        key = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
        if key.lower() not in _MACHINE:
            raise RuntimeError(f"NVML_ERROR_NOT_FOUND {key}")
        return key.lower()

    nvml.nvmlDeviceGetHandleByPciBusId = by_bus_id
    nvml.nvmlDeviceGetHandleByIndex = lambda i: by_index[i]
    nvml.nvmlDeviceGetCurrPcieLinkGeneration = lambda h: _MACHINE[h][1]
    nvml.nvmlDeviceGetCurrPcieLinkWidth = lambda h: _MACHINE[h][2]
    nvml.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: _MACHINE[h][3]
    nvml.nvmlDeviceGetMaxPcieLinkWidth = lambda h: _MACHINE[h][4]
    return nvml


@pytest.fixture
def machine(monkeypatch):
    """CUDA_VISIBLE_DEVICES=2,3: torch's cuda:0 and cuda:1 are NVML's devices 2 and 3."""
    visible = ["0000:5e:00.0", "0000:86:00.0"]

    def props(index):
        domain, bus, rest = visible[index].split(":")
        return types.SimpleNamespace(pci_domain_id=int(domain, 16), pci_bus_id=int(bus, 16),
                                     pci_device_id=int(rest.split(".")[0], 16))

    nvml = _fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    return nvml


def test_the_ceiling_is_the_link_of_the_gpu_with_torchs_pci_bus_id(machine):
    assert probe_cli.pcie_ceiling(0) == (
        "PCIe gen 5 x16 (max gen 5 x16) at 0000:5e:00.0", pytest.approx(63.0, abs=0.1))
    text, rate = probe_cli.pcie_ceiling(1)
    assert text == "PCIe gen 3 x4 (max gen 5 x16) at 0000:86:00.0"   # trained down: current
    assert rate == pytest.approx(3.94, abs=0.01)
    assert machine.calls == ["init", "shutdown"] * 2


def test_without_a_pci_bus_id_from_torch_the_ceiling_is_unknown(machine, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(name="old torch"))
    assert probe_cli.pcie_ceiling(0) == (
        "unknown (torch reports no PCI bus id for cuda:0, so its NVML device cannot be told "
        "apart)", None)


def test_an_nvml_error_is_reported_with_the_bus_id(machine, monkeypatch):
    monkeypatch.setattr(machine, "nvmlDeviceGetHandleByPciBusId",
                        lambda bus_id: (_ for _ in ()).throw(RuntimeError("NVML_ERROR_UNKNOWN")))
    assert probe_cli.pcie_ceiling(0) == (
        "unknown (NVML, GPU at 0000:5e:00.0: NVML_ERROR_UNKNOWN)", None)
    assert machine.calls == ["init", "shutdown"]
