"""README's first screen is the contract with a new user: exactly two commands, and CI runs
the second one verbatim (so a green CI proves the command a user types)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    first_screen = "\n".join(text.splitlines()[:40])
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", first_screen, flags=re.S)
    assert blocks, "README.md: no ```bash block on the first screen (first 40 lines)"
    return [ln.split("  #")[0].strip() for ln in blocks[0].splitlines()
            if ln.strip() and not ln.lstrip().startswith("#")]


def test_first_screen_has_exactly_two_commands():
    cmds = _quick_start_commands()
    assert len(cmds) == 2, f"expected 2 commands (benchmark, tests), got {cmds}"
    assert "offload-bench" in cmds[0], cmds[0]
    assert "pytest" in cmds[1], cmds[1]


def test_ci_runs_the_readme_test_command_verbatim():
    test_cmd = _quick_start_commands()[1]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert test_cmd in ci, f".ci/run does not run README's test command {test_cmd!r}"


def test_ci_pins_the_cpu_torch_build():
    # An unpinned torch pulls a multi-GB CUDA build on CI machines.
    assert "torch==2.13.0" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
