"""Where the GPU paths cannot be used, the context says why when it is built (ConfigError
naming cause and fix), never mid-forward; `offload.build_info()` reports the same status.

This machine has no GPU: torch's answers are replaced (monkeypatch) to play a GPU machine
whose torch can use the GPU while some piece offload needs is missing."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import offload
from offload import _ext
from offload.util import gpu_support
from offload._build_info import summary


@pytest.fixture
def torch_sees_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "12.8")


def test_build_info_on_this_cpu_machine():
    info = offload.build_info()
    assert info["version"] == offload.__version__ == offload._version.__version__
    assert info["torch"] == torch.__version__
    json.dumps(info)   # stored in offload-bench's JSON
    if torch.version.cuda is None:
        assert not info["gpu_usable"]
        assert info["gpu_unusable_reason"] == f"torch {torch.__version__} is a CPU-only build"
        assert "GPU not usable: torch" in summary(info)


def test_a_runtime_the_core_cannot_find_is_a_config_error_at_construction(torch_sees_a_gpu):
    # The real core of this machine: CUDA paths compiled in, but a CPU torch loaded no runtime.
    if not _ext.load_core().cuda_compiled:
        pytest.skip("offload._C built with OFFLOAD_BUILD_CUDA=0")
    with pytest.raises(offload.ConfigError, match=(
            r"^offload\.activations\(tiers='host,nvme'\): CUDA tensors would be moved, but the "
            r"GPU paths cannot be used: torch can use the GPU but offload's core cannot: no CUDA "
            r"runtime library \(libcudart\.so\.\*\) is loaded .*finds none loaded.*ctypes\.CDLL\('libcudart\.so\.N'"
            r".*CUDA_VISIBLE_DEVICES=''")):
        offload.activations(tiers="host,nvme", nvme_dir="/var/tmp")
    info = offload.build_info()
    assert not info["gpu_usable"] and info["gpu_unusable_reason"].startswith(
        "torch can use the GPU but offload's core cannot: no CUDA runtime library")


def test_nothing_to_check_when_no_cuda_tensor_can_come(torch_sees_a_gpu):
    cpu_model = torch.nn.Linear(4, 4)
    offload.activations(tiers="host", model=cpu_model)     # the model is on the CPU
    offload.activations(tiers="host", policy="keep")        # nothing moves
    with pytest.raises(offload.ConfigError):
        offload.activations(tiers="host")                   # no model: CUDA tensors may come


@pytest.mark.parametrize("case, reason, fix", [
    ("cpu-build", r"offload\._C was built without its CUDA paths \(OFFLOAD_BUILD_CUDA=0\)",
     "reinstall offload with OFFLOAD_BUILD_CUDA unset"),
    ("no-core", r"the compiled core offload\._C is not available \(ImportError: gone\)",
     r"pip install -e \."),
    ("rocm", r"torch .* is a ROCm build; the GPU paths call the CUDA runtime",
     "use a CUDA build of torch"),
])
def test_each_missing_piece_names_its_cause_and_fix(torch_sees_a_gpu, monkeypatch, case, reason,
                                                    fix):
    if case == "cpu-build":
        monkeypatch.setattr(_ext, "load_core", lambda: SimpleNamespace(cuda_compiled=False))
        monkeypatch.setattr(_ext, "core_available", lambda: True)
    elif case == "no-core":
        monkeypatch.setattr(_ext, "core_available", lambda: False)
        monkeypatch.setattr(_ext, "core_unavailable_reason", lambda: "ImportError: gone")
    else:
        monkeypatch.setattr(torch.version, "hip", "6.2")
    with pytest.raises(offload.ConfigError, match=f"GPU paths cannot be used: {reason} .*{fix}"):
        offload.activations(tiers="host")
    s = gpu_support.status()
    assert not s.usable and s.fix


def test_torch_with_cuda_but_no_device(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    s = gpu_support.status()
    assert not s.usable and "torch.cuda.is_available() is False" in s.reason
    assert "CUDA_VISIBLE_DEVICES" in s.fix
    offload.activations(tiers="host")   # a CPU run: nothing to refuse


def test_usable_when_every_piece_is_there(torch_sees_a_gpu, monkeypatch):
    runtime = {"path": "/x/libcudart.so.12", "runtime_version": 12080, "driver_version": 12090}
    core = SimpleNamespace(cuda_compiled=True, cuda_usable=lambda: True,
                           cuda_runtime=lambda: runtime, build_flavour="cuda-dlopen",
                           __version__=offload.__version__)
    monkeypatch.setattr(_ext, "load_core", lambda: core)
    monkeypatch.setattr(_ext, "core_available", lambda: True)
    offload.activations(tiers="host")
    info = offload.build_info()
    assert info["gpu_usable"] and info["cuda_runtime"] == runtime
    assert "GPU usable (CUDA runtime 12.8)" in summary(info)
