"""Imports point down the layer list of CONVENTIONS.md: a module imports from its own layer or a lower one.

Every module under src/tpkit is parsed (nothing is imported), and every import is checked: at module level,
inside functions (lazy imports count), under TYPE_CHECKING, relative ones resolved against the importing
module's package, and `importlib.import_module("tpkit....")` with a literal name. Beyond the direction:
- no import cycle among tpkit modules (lazy imports included: a cycle hidden in a function is still a cycle);
- no import the test cannot name: a dynamic import whose name is not a literal (or a literal relative one
  resolved against `__name__` / `__package__`) fails unless it is a user's module, listed in USER_IMPORTS;
- no private name (`_x`) imported from another module;
- checkpoint and estimate, side by side above convert, never import each other.
"""
from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
ROOT = "tpkit"

# Top to bottom. Modules of layers that do not exist yet are listed so that their first import is checked.
LAYERS: list[tuple[str, ...]] = [
    ("tpkit.cli", "tpkit.commands"),
    ("tpkit.trainer",),
    ("tpkit.data_parallel", "tpkit.recompute", "tpkit.setups", "tpkit.pipeline"),
    ("tpkit.checkpoint", "tpkit.estimate", "tpkit.replicas", "tpkit.context", "tpkit.experts"),
    ("tpkit.convert",),
    ("tpkit.nn",),
    ("tpkit.distributed", "tpkit.launch", "tpkit.faults"),
    ("tpkit.comm",),
    ("tpkit.layout", "tpkit.tables", "tpkit.quant"),
]
# Packages of one layer that must not import each other either way.
APART: tuple[tuple[str, str], ...] = (("tpkit.checkpoint", "tpkit.estimate"),)
# Dynamic imports of a name that is not a literal, allowed because they import the user's module, never tpkit's:
# module -> why.
USER_IMPORTS: dict[str, str] = {
    "tpkit.estimate.presets": "`tpkit estimate mymodels:build` imports the user's `module:factory` target",
}
# tpkit/__init__.py is the public API: it may import anything. Imported, it counts as the top layer, since it
# imports every layer (so `import tpkit` from below is an upward import).
PUBLIC_API_LAYER = 1

# Known upward imports outside comm/, each (importing module, imported module) with where it is and why it
# may stay for now. Each is to be removed by fixing the import; an entry that no longer matches fails.
ALLOWED: dict[tuple[str, str], str] = {}


def layer_of(module: str) -> int | None:
    """The layer number (1 = top) of a tpkit module, by its longest listed prefix; None if not listed."""
    if module == ROOT:
        return PUBLIC_API_LAYER
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for number, prefixes in enumerate(LAYERS, start=1):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), number)
    return None if best is None else best[1]


def describe_layer(number: int) -> str:
    return f"layer {number} ({', '.join(LAYERS[number - 1])})"


@dataclasses.dataclass(frozen=True)
class Import:
    line: int
    target: str  # the imported module, absolute


def _resolve_from(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a `from ... import` names; relative levels count from the importing package."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    if node.level - 1 > len(package) - 1:
        raise ValueError(f"{module}: relative import beyond the top-level package at line {node.lineno}")
    base = package[:len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _literal_prefix(arg: ast.expr) -> str | None:
    """The module a literal (or an f-string's leading literal, up to its last dot) names."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        head = str(arg.values[0].value)
        return head.rsplit(".", 1)[0] if "." in head else None
    return None


UNNAMED = "<a name the test cannot read>"


def _dynamic_import(node: ast.Call, module: str, is_package: bool) -> str | None:
    """The module `importlib.import_module(name[, package])` or `__import__(name)` imports: a literal name, a
    literal relative name resolved against `__name__` / `__package__`, else UNNAMED; None for other calls."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name not in ("import_module", "__import__") or not node.args:
        return None
    target = _literal_prefix(node.args[0])
    if target is None:
        return UNNAMED
    if target.startswith("."):
        anchor = node.args[1] if len(node.args) > 1 else None
        if not (isinstance(anchor, ast.Name) and anchor.id in ("__name__", "__package__")):
            return UNNAMED
        level = len(target) - len(target.lstrip("."))
        package = module.split(".") if is_package else module.split(".")[:-1]
        rest = target.lstrip(".")
        return ".".join(package[:len(package) - (level - 1)] + ([rest] if rest else []))
    return target


def imports_of(source: str, module: str, is_package: bool = False,
               known_modules: frozenset[str] = frozenset()) -> list[Import]:
    """Every tpkit module `source` (the text of `module`) imports, wherever the import statement is.

    `from pkg import name` imports `pkg.name` when that is a module in `known_modules`, else `pkg`.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(node, module, is_package)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if sub in known_modules else base)
        elif isinstance(node, ast.Call):
            target = _dynamic_import(node, module, is_package)
            targets = [target] if target else []
        found += [Import(node.lineno, t) for t in dict.fromkeys(targets)
                  if t == ROOT or t.startswith(ROOT + ".") or t == UNNAMED]
    return sorted(found, key=lambda i: (i.line, i.target))


def upward_imports(source: str, module: str, path: str, is_package: bool = False,
                   known_modules: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """(imported module, message) for every import in `source` that points up the layer list, or at a tpkit
    module the table does not list."""
    mine = layer_of(module)
    if mine is None:
        return [("", f"{path}: module {module} is in no layer; add it to LAYERS in {__name__}")]
    problems = []
    for imp in imports_of(source, module, is_package, known_modules):
        if imp.target == UNNAMED:
            if module not in USER_IMPORTS:
                problems.append((imp.target, f"{path}:{imp.line} imports a module by a name that is not a literal, so "
                                             f"its layer cannot be checked; name the tpkit module literally (or list "
                                             f"a user-module import in USER_IMPORTS of {__name__})"))
            continue
        theirs = layer_of(imp.target)
        apart = [pair for pair in APART if any(_within(module, a) and _within(imp.target, b) for a, b in (pair, pair[::-1]))]
        if apart:
            problems.append((imp.target, f"{path}:{imp.line} imports {imp.target}: {apart[0][0]} and {apart[0][1]} "
                                         f"must not import each other"))
        elif theirs is None:
            problems.append((imp.target, f"{path}:{imp.line} imports {imp.target}, which is in no layer; "
                                         f"add it to LAYERS in {__name__}"))
        elif theirs < mine:
            problems.append((imp.target, f"{path}:{imp.line} imports {imp.target}: {describe_layer(theirs)} is "
                                         f"above {module}'s {describe_layer(mine)}"))
    return problems


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def private_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """`from tpkit.x import _name` (a private name of another module), as messages."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = _resolve_from(node, module, is_package)
            if base != module and (base == ROOT or base.startswith(ROOT + ".")):
                out += [f"{module}:{node.lineno} imports the private name {alias.name} from {base}"
                        for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]
    return out


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of two or more modules (or a module importing itself), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; tpkit's graph is a few hundred nodes deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph.get(v, ()):
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def import_graph(sources: dict[str, tuple[str, bool]], known: frozenset[str]) -> dict[str, set[str]]:
    """module -> the tpkit modules it imports anywhere (the nearest known module of each target)."""
    graph: dict[str, set[str]] = {}
    for module, (source, is_package) in sources.items():
        targets = set()
        for imp in imports_of(source, module, is_package, known):
            t = imp.target
            while t not in known and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in known and t != module:
                targets.add(t)
        graph[module] = targets
    return graph


def _module_name(path: pathlib.Path) -> tuple[str, bool]:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _tree() -> list[tuple[pathlib.Path, str, bool]]:
    return [(path, *_module_name(path)) for path in sorted((SRC / ROOT).rglob("*.py"))]


def test_imports_point_down_the_layers():
    tree = _tree()
    known = frozenset(name for _, name, _ in tree)
    problems, used = [], set()
    for path, module, is_package in tree:
        if module == ROOT:
            continue  # the public API may import anything
        shown = str(path.relative_to(SRC.parent))
        for target, message in upward_imports(path.read_text(), module, shown, is_package, known):
            key = (module, target)
            if key in ALLOWED:
                used.add(key)
            else:
                problems.append(message)
    stale = [f"ALLOWED entry {key} matches no import any more; remove it" for key in ALLOWED if key not in used]
    assert not problems + stale, "imports must point down the layer list:\n" + "\n".join(problems + stale)


def test_no_import_cycle_and_no_private_name_crosses_a_module():
    tree = _tree()
    known = frozenset(name for _, name, _ in tree)
    sources = {module: (path.read_text(), is_package) for path, module, is_package in tree}
    cycles = import_cycles(import_graph(sources, known))
    assert not cycles, "import cycles (lazy imports included):\n" + "\n".join(" <-> ".join(c) for c in cycles)
    private = [m for module, (src, pkg) in sources.items() for m in private_imports(src, module, pkg)]
    assert not private, "private names imported across modules:\n" + "\n".join(private)


def test_a_cycle_is_found_even_through_a_lazy_import():
    sources = {"tpkit.estimate.step": ("from .traced import trace_rank\n", False),
               "tpkit.estimate.traced": ("def f():\n    from .step import prepare\n", False),
               "tpkit.estimate.memory": ("from .step import prepare\n", False)}
    graph = import_graph(sources, frozenset(sources))
    assert import_cycles(graph) == [["tpkit.estimate.step", "tpkit.estimate.traced"]]
    del sources["tpkit.estimate.traced"]
    assert import_cycles(import_graph(sources, frozenset(sources))) == []


def test_an_import_the_test_cannot_name_is_reported():
    hidden = "import importlib\n\ndef __getattr__(name):\n    return importlib.import_module(TABLE[name], __name__)\n"
    found = upward_imports(hidden, "tpkit.convert", "x.py", is_package=True)
    assert [t for t, _ in found] == [UNNAMED] and "not a literal" in found[0][1]
    named = "import importlib\nimportlib.import_module('.speed', __name__)\n"
    assert [i.target for i in imports_of(named, "tpkit.estimate", True)] == ["tpkit.estimate.speed"]
    assert upward_imports("import importlib\nimportlib.import_module(target)\n", "tpkit.estimate.presets", "x.py") == []


def test_a_private_name_from_another_module_is_reported():
    assert private_imports("from .config import _own_dtype, resolve\n", "tpkit.estimate.speed") == [
        "tpkit.estimate.speed:1 imports the private name _own_dtype from tpkit.estimate.config"]
    assert private_imports("from .config import __version__, resolve\n", "tpkit.estimate.speed") == []


def test_checkpoint_and_estimate_never_import_each_other():
    found = upward_imports("def f():\n    from ..estimate import estimate_memory\n", "tpkit.checkpoint.load", "x.py")
    assert [t for t, _ in found] == ["tpkit.estimate"] and "must not import each other" in found[0][1]
    assert upward_imports("from ..convert import plan\n", "tpkit.estimate.search", "x.py") == []


UPWARD = """
from __future__ import annotations

from ..comm import ReduceOp


def lazy():
    from ..convert import parallelize  # upward, and inside a function
    return parallelize
"""


def test_an_upward_import_is_reported_with_file_line_target_and_both_layers():
    problems = upward_imports(UPWARD, "tpkit.nn.linear", "src/tpkit/nn/linear.py")
    assert problems == [("tpkit.convert", "src/tpkit/nn/linear.py:8 imports tpkit.convert: layer 5 (tpkit.convert) "
                                          "is above tpkit.nn.linear's layer 6 (tpkit.nn)")]


def test_layout_is_the_bottom_of_the_house():
    problems = upward_imports("from ..comm import ReduceOp\n", "tpkit.layout.shard", "x.py")
    assert [t for t, _ in problems] == ["tpkit.comm"]
    assert upward_imports("from ..layout import ShardLayout\n", "tpkit.comm.checks", "x.py") == []


@pytest.mark.parametrize("source, module, is_package, target", [
    ("from ..distributed import init", "tpkit.comm", True, "tpkit.distributed"),  # the package's own __init__
    ("from ...nn.linear import x", "tpkit.comm.algorithms.steps", False, "tpkit.nn.linear"),
    ("import tpkit.checkpoint.io", "tpkit.convert.shard", False, "tpkit.checkpoint.io"),
    ("from tpkit import nn", "tpkit.launch", False, "tpkit.nn"),
    ("from .. import data_parallel", "tpkit.checkpoint.save", False, "tpkit.data_parallel"),
    ("import tpkit", "tpkit.nn.linear", False, "tpkit"),
    ("if TYPE_CHECKING:\n    from tpkit.cli import main", "tpkit.comm.ops", False, "tpkit.cli"),
    ("import importlib\nimportlib.import_module(f'tpkit.commands.{name}')", "tpkit.convert", True, "tpkit.commands"),
])
def test_every_form_of_upward_import_is_seen(source, module, is_package, target):
    known = frozenset({"tpkit.nn", "tpkit.data_parallel"})
    found = upward_imports(source, module, "x.py", is_package, known)
    assert [t for t, _ in found] == [target]


@pytest.mark.parametrize("source, module", [
    ("from ..layout import split_sizes", "tpkit.nn.partition"),
    ("from . import distributed", "tpkit.launch"),  # the same layer
    ("import tpkit\nfrom tpkit.convert import analyze", "tpkit.commands.demo"),
    ("import torch\nfrom torch import nn", "tpkit.comm.ops"),
])
def test_imports_down_or_sideways_are_not_reported(source, module):
    assert upward_imports(source, module, "x.py", known_modules=frozenset({"tpkit.distributed"})) == []


def test_a_module_in_no_layer_is_reported():
    assert "is in no layer" in upward_imports("", "tpkit.extras", "x.py")[0][1]
    assert "is in no layer" in upward_imports("import tpkit.extras", "tpkit.nn.linear", "x.py")[0][1]
