"""offload/schedule/ imports run one way: no module imports one that imports it back, even
through a function-level (lazy) import. Read from the source, so a circle hidden by import
order (the first module imported wins) is caught too."""
from __future__ import annotations

import ast
import pathlib

import offload.schedule

SCHEDULE = pathlib.Path(offload.schedule.__file__).parent


def _imports(path: pathlib.Path) -> set[str]:
    """The schedule modules `path` imports, anywhere in it (module level or in a function,
    TYPE_CHECKING blocks included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                if node.module:   # from .plan import Plan
                    out.add(node.module.split(".")[0])
                else:             # from . import clock
                    out.update(a.name for a in node.names)
            elif node.level == 2 and (node.module or "").startswith("schedule"):
                parts = node.module.split(".")
                out.update([parts[1]] if len(parts) > 1 else [a.name for a in node.names])
            elif node.level == 0 and (node.module or "").startswith("offload.schedule."):
                out.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("offload.schedule."):
                    out.add(a.name.split(".")[2])
    return out


def _graph() -> dict[str, set[str]]:
    modules = {p.stem for p in SCHEDULE.glob("*.py")} - {"__init__"}
    return {m: _imports(SCHEDULE / f"{m}.py") & modules for m in modules}


def test_schedule_modules_import_one_way():
    graph = _graph()
    assert {"plan", "explain", "placement", "session", "auto_session"} <= set(graph)
    order: list[str] = []
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        if state.get(module) == "done":
            return
        if state.get(module) == "open":
            circle = path[path.index(module):] + [module]
            raise AssertionError("import circle: " + " -> ".join(circle))
        state[module] = "open"
        for dep in sorted(graph[module]):
            visit(dep, path + [module])
        state[module] = "done"
        order.append(module)

    for module in sorted(graph):
        visit(module, [])
    # The directions the layout promises (docs: plan is data, explain renders it).
    assert "explain" not in graph["plan"] and "plan" in graph["explain"]
    assert not graph["placement"] & {"session", "auto_session", "session_base"}
    assert not graph["constants"]


def test_the_check_sees_a_circle(tmp_path, monkeypatch):
    """The check itself: two modules importing each other, one lazily, are reported."""
    (tmp_path / "a.py").write_text("from .b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from .a import y\n")
    monkeypatch.setattr(__import__(__name__), "SCHEDULE", tmp_path)
    graph = _graph()
    assert graph == {"a": {"b"}, "b": {"a"}}
