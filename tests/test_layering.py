"""Imports run one way: errors -> allocator -> block table -> storage/attention -> cache -> manager -> tools.

Read from the source with ``ast``, so a new module is checked the day it is
added: no cycle among module-level imports, the bottom layers stay free of
numpy and of everything above them, and no core module imports a tool built
on it (the simulator, the conformance kit, integrations, the CLI).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "pagedkv"

#: Packages and modules built on the core; the core never imports them.
TOOLS = ("pagedkv.simulate", "pagedkv.testing", "pagedkv.integrations", "pagedkv.cli", "pagedkv.snapshot")
#: Modules that may import the manager (it is near the top).
ABOVE_MANAGER = ("pagedkv.integrations.interop", "pagedkv.cli.demo", "pagedkv.__main__", *TOOLS)
#: The bottom: ints and errors only, no numpy (STYLE.md: the allocator never sees an array).
BOTTOM = {"pagedkv.errors": set(), "pagedkv.counts": {"pagedkv.errors"},
          "pagedkv.blocks.cached_blocks": {"pagedkv.errors"},
          "pagedkv.blocks.allocator": {"pagedkv.errors", "pagedkv.counts", "pagedkv.blocks.cached_blocks"}}


def _module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
    return name.removesuffix(".__init__")


def _imports(path: Path, *, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _graph(*, top_level_only: bool) -> dict[str, set[str]]:
    return {
        _module_name(path): _imports(path, top_level_only=top_level_only)
        for path in sorted(ROOT.rglob("*.py"))
    }


def _is_under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes)


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (``[a, b, a]``), or None; edges to unknown modules are ignored."""
    inner = {name: {dep for dep in deps if dep in graph and dep != name} for name, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> list[str] | None:
        state[name] = 1
        for dep in sorted(inner[name]):
            if state.get(dep) == 1:
                return [*path[path.index(dep):], dep]
            if dep not in state and (cycle := visit(dep, [*path, dep])):
                return cycle
        state[name] = 2
        return None

    for name in sorted(inner):
        if name not in state and (cycle := visit(name, [name])):
            return cycle
    return None


def test_no_import_cycle_among_module_level_imports() -> None:
    graph = _graph(top_level_only=True)
    graph.pop("pagedkv")  # the package re-exports; its modules import each other, not it
    cycle = _find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


def test_the_bottom_layers_import_only_what_is_below_them() -> None:
    graph = _graph(top_level_only=False)
    for name, allowed in BOTTOM.items():
        imported = {dep for dep in graph[name] if dep.startswith("pagedkv") or dep == "numpy"}
        assert imported <= allowed, f"{name} imports {sorted(imported - allowed)}"


def test_no_core_module_imports_the_tools_or_the_manager() -> None:
    graph = _graph(top_level_only=False)
    for name, deps in graph.items():
        if name == "pagedkv" or _is_under(name, ABOVE_MANAGER):
            continue
        for dep in deps:
            assert not _is_under(dep, TOOLS), f"core module {name} imports the tool {dep}"
            if name != "pagedkv.manager.manager":
                assert dep != "pagedkv.manager.manager", f"{name} imports the manager, which sits above it"


def test_the_checker_sees_a_planted_cycle(tmp_path: Path) -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "numpy"}, "b": set()}) is None
    # Module-level imports only, for the cycle check; every import, for the layer rules.
    (tmp_path / "c.py").write_text("from pagedkv.b import x\ndef f():\n    from pagedkv.d import y\n")
    assert _imports(tmp_path / "c.py", top_level_only=True) == {"pagedkv.b"}
    assert _imports(tmp_path / "c.py", top_level_only=False) == {"pagedkv.b", "pagedkv.d"}
