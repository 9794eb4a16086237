"""Imports run one way: blocks -> memory -> attention -> cache; prefix -> tiers -> manager -> tools.

Read from the source with ``ast``, so a new module is checked the day it is
added: every package imports only the layers below it, no module imports
another in a circle (function-level and ``TYPE_CHECKING`` imports included),
the allocator never imports numpy, and ``pagedkv/`` keeps at most ten
top-level modules. The layers and the reason for each are drawn in
docs/architecture.md.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "pagedkv"

#: The helpers every layer may use: errors, counts, input checks.
BASE = ("pagedkv.errors", "pagedkv.counts", "pagedkv.inputs")
#: Built on the library; any of them may import anything but ``pagedkv.__main__``.
TOOLS = (
    "pagedkv.integrations", "pagedkv.snapshot", "pagedkv.testing", "pagedkv.simulate",
    "pagedkv.cli", "pagedkv.__main__",
)
#: Each layer and what it may import besides itself (its own package) and BASE.
#: NOTE: ``reference`` (the dense recompute) is a helper over memory and attention;
#: ``locking`` sits beside attention, used by the cache and the manager.
LAYERS: dict[str, tuple[str, ...]] = {
    "pagedkv.blocks": (),
    "pagedkv.memory": ("pagedkv.blocks",),
    # Compiled kernels (the ``jit`` extra): arrays in, arrays out, nothing of pagedkv.
    "pagedkv.kernels": (),
    "pagedkv.attention": ("pagedkv.blocks", "pagedkv.memory", "pagedkv.kernels"),
    "pagedkv.locking": ("pagedkv.blocks", "pagedkv.memory"),
    "pagedkv.reference": ("pagedkv.blocks", "pagedkv.memory", "pagedkv.attention"),
    "pagedkv.cache": (
        "pagedkv.blocks", "pagedkv.memory", "pagedkv.attention", "pagedkv.locking", "pagedkv.reference",
    ),
    "pagedkv.prefix": ("pagedkv.blocks",),
    # Host tier and stores under the device pool (issue 31): whole blocks by prefix key.
    "pagedkv.tiers": ("pagedkv.blocks", "pagedkv.memory", "pagedkv.prefix"),
    "pagedkv.manager": (
        "pagedkv.blocks", "pagedkv.memory", "pagedkv.attention", "pagedkv.locking",
        "pagedkv.reference", "pagedkv.prefix", "pagedkv.tiers",
    ),
}
#: The allocator sees block ids, never an array (docs/architecture.md, "blocks").
ALLOCATOR = "pagedkv.blocks.allocator"
#: ``pagedkv/`` itself: ``__init__``, ``__main__`` and at most this many more modules.
MAX_TOP_LEVEL_MODULES = 10


def _module_name(path: Path, root: Path = ROOT) -> str:
    name = ".".join(path.relative_to(root.parent).with_suffix("").parts)
    return name.removesuffix(".__init__")


def _imports(path: Path, *, root: Path = ROOT) -> set[str]:
    """Every module ``path`` imports, anywhere in it (functions and ``TYPE_CHECKING`` blocks too).

    ``from a import b`` counts as ``a``, and as ``a.b`` as well (``b`` may be a
    module); relative imports are resolved. The checks keep only names they know.
    """
    package = _module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *filter(None, [node.module])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Each module of the package and the modules of the package it imports (shared: copy to change)."""
    return _parsed_graph(root)


# NOTE: cached: six tests read the graph; parsing every module once per test took 2 s.
@functools.cache
def _parsed_graph(root: Path) -> dict[str, set[str]]:
    paths = {_module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    return {name: {dep for dep in _imports(path, root=root) if dep in paths and dep != name}
            for name, path in paths.items()}


def _is_under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes)


def _layer(module: str) -> str | None:
    return next((layer for layer in LAYERS if _is_under(module, (layer,))), None)


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


def _graph_without_the_api(root: Path = ROOT) -> dict[str, set[str]]:
    graph = dict(_graph(root))
    # The package re-exports (its modules import each other, not it); a package's
    # __init__ importing its own modules, which import it back by their dotted
    # path, is how Python packages work and not a circle between concepts.
    graph.pop(root.name, None)
    return {name: {dep for dep in deps if not name.startswith(dep + ".")} for name, deps in graph.items()}


def test_no_import_circle_among_modules_function_level_imports_included() -> None:
    cycle = _find_cycle(_graph_without_the_api())
    assert cycle is None, f"import circle: {' -> '.join(cycle or [])}"


def test_every_layer_imports_only_the_layers_below_it() -> None:
    wrong = []
    for name, deps in _graph().items():
        if name == "pagedkv" or _is_under(name, TOOLS):
            continue
        allowed = BASE if _is_under(name, BASE) else (*BASE, *LAYERS[_layer(name) or name])
        own = _layer(name) or name
        for dep in deps:
            if dep == "pagedkv" or not (_is_under(dep, (own, *allowed)) or dep.startswith(name + ".")):
                wrong.append(f"{name} imports {dep}")
    assert not wrong, "imports against the layer order:\n" + "\n".join(sorted(wrong))


def test_every_module_belongs_to_a_layer_or_a_tool() -> None:
    unknown = [name for name in _graph() if name != "pagedkv"
               and not _is_under(name, (*BASE, *LAYERS, *TOOLS))]
    assert not unknown, f"modules outside every layer (add them to LAYERS or TOOLS): {unknown}"


def test_the_helpers_at_the_bottom_import_only_each_other() -> None:
    graph = _graph()
    assert graph["pagedkv.errors"] == set()
    for name in BASE:
        assert graph[name] <= set(BASE), f"{name} imports {sorted(graph[name] - set(BASE))}"


def test_the_allocator_imports_no_numpy_and_nothing_but_the_helpers() -> None:
    path = ROOT / "blocks" / "allocator.py"
    imported = {dep for dep in _imports(path) if dep.startswith("pagedkv") or dep.split(".")[0] == "numpy"}
    assert not any(dep.split(".")[0] == "numpy" for dep in imported), f"{ALLOCATOR} imports numpy"
    assert _graph()[ALLOCATOR] <= set(BASE), f"{ALLOCATOR} imports {sorted(_graph()[ALLOCATOR])}"


def test_the_top_of_the_package_holds_at_most_ten_modules() -> None:
    modules = sorted(path.stem for path in ROOT.glob("*.py") if path.stem not in ("__init__", "__main__"))
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, f"{len(modules)} top-level modules: {modules}"


def test_the_checker_sees_planted_circles_and_layer_breaks(tmp_path: Path) -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "numpy"}, "b": set()}) is None
    # A function-level import and a TYPE_CHECKING import close a circle as surely as a module-level one.
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "a.py").write_text("from pkg.b import x\n")
    (root / "b.py").write_text("def f():\n    from pkg.c import y\n")
    (root / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    assert _find_cycle(_graph_without_the_api(root)) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    assert _imports(root / "c.py", root=root) >= {"pkg", "pkg.a"}
    assert _layer("pagedkv.blocks.allocator") == "pagedkv.blocks"
    assert _layer("pagedkv.attention") == "pagedkv.attention"
    assert _layer("pagedkv.attentions") is None
