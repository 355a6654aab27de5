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


def _readme() -> str:
    return (ROOT / "README.md").read_text(encoding="utf-8")


def test_every_example_is_in_the_readme_table_and_nothing_else():
    """README's example table lists each script in examples/ once, with the command CI runs
    it by (tests/test_examples.py), so a command a user copies works."""
    rows = re.findall(r"^\| `((?:python|torchrun)[^`]*?(examples/\w+\.py)[^`]*)` \|", _readme(),
                      flags=re.M)
    listed = sorted(path for _, path in rows)
    on_disk = sorted(f"examples/{p.name}" for p in (ROOT / "examples").glob("*.py"))
    assert listed == on_disk
    for cmd, _ in rows:
        assert "--check" in cmd, f"README example command without --check: {cmd}"
        if cmd.startswith("torchrun"):
            assert "--nproc-per-node" in cmd, cmd


def test_files_named_next_to_figures_exist():
    """Every script or test a README / docs command names (`python benchmarks/x.py ...`,
    `tests/test_rss.py`, `examples/...`) is in the repository: a moved or renamed file
    must take its figures' commands along."""
    missing = []
    for doc in ["README.md", "docs/design.md", "docs/benchmarks.md"]:
        text = (ROOT / doc).read_text(encoding="utf-8")
        for path in set(re.findall(r"\b((?:benchmarks|tests|examples|offload)/[\w/]+\.(?:py|sh))",
                                   text)):
            if not (ROOT / path).exists():
                missing.append(f"{doc}: {path}")
    assert not missing, missing


def _anchors(markdown: str) -> set[str]:
    """The anchors GitHub makes of a Markdown file's headings: lower case, punctuation
    but hyphens and underscores dropped, spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in markdown.splitlines() if line.startswith("#")}


def test_readme_links_resolve():
    """Every link to a Markdown file exists, and so does the heading its anchor names (a
    helper found a link to a section docs/benchmarks.md never had)."""
    for target, anchor in re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)(?:#([\w-]+))?\)",
                                     _readme()):
        assert (ROOT / target).exists(), target
        if anchor:
            assert anchor in _anchors((ROOT / target).read_text()), f"{target}#{anchor}"
