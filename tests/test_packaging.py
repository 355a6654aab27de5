"""Packaging metadata that a release depends on, checked from the files (no build here:
.ci/package builds and installs the sdist and the wheel)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import offload

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_the_torch_floor_is_the_release_ci_tests():
    (torch_req,) = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch")]
    floor = re.fullmatch(r"torch>=(\d+\.\d+)", torch_req)
    assert floor, f"pyproject.toml: expected 'torch>=X.Y', got {torch_req!r}"
    pins = set(re.findall(r"torch==(\d+\.\d+)\.\d+", (ROOT / ".ci" / "run").read_text()))
    pins |= set(re.findall(r"torch==(\d+\.\d+)\.\d+", (ROOT / ".ci" / "package").read_text()))
    assert pins == {floor.group(1)}, (
        f"CI installs torch {sorted(pins)} but pyproject claims torch>={floor.group(1)}: test the "
        "floor in CI or raise it to what CI tests")


def test_license_version_and_typing_metadata():
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text() \
        and "Version 2.0" in (ROOT / "LICENSE").read_text()
    assert project["dynamic"] == ["version"]
    regex = PYPROJECT["tool"]["scikit-build"]["metadata"]["version"]
    assert regex["input"] == "offload/_version.py"
    assert re.search(r'^__version__ = "([^"]+)"', (ROOT / regex["input"]).read_text(), re.M)
    assert offload.__version__ == offload._version.__version__
    assert (ROOT / "offload" / "py.typed").exists()
    classifiers = project["classifiers"]
    for minor in range(10, 14):
        assert f"Programming Language :: Python :: 3.{minor}" in classifiers
    assert "Typing :: Typed" in classifiers


def test_cibuildwheel_builds_every_claimed_python_and_platform():
    cfg = PYPROJECT["tool"]["cibuildwheel"]
    assert cfg["build"].split() == ["cp310-*", "cp311-*", "cp312-*", "cp313-*"]
    assert set(cfg["archs"]) == {"x86_64", "aarch64"}
    assert cfg["manylinux-x86_64-image"] == cfg["manylinux-aarch64-image"] == "manylinux_2_28"
    assert "tools/check_wheel.py" in cfg["test-command"]
    assert (ROOT / "tools" / "check_wheel.py").exists()


def test_ci_builds_and_installs_sdist_and_wheel_with_the_toolkit_hidden():
    run = (ROOT / ".ci" / "run").read_text()
    package = (ROOT / ".ci" / "package").read_text()
    assert "bash .ci/package" in run
    assert run.index("bash .ci/package") < run.index("python -m pytest")
    for needed in ("--sdist", "pip\" wheel", "-u CUDA_HOME", "CMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON",
                   "tools/check_wheel.py", "tools/smoke.py"):
        assert needed in package, needed
