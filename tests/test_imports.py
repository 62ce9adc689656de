"""Imports point down the layer list of CONVENTIONS.md: a module imports from its own layer or a lower one.

Every module under src/tpkit is parsed (nothing is imported), and every import is checked: at module level,
inside functions (lazy imports count), under TYPE_CHECKING, relative ones resolved against the importing
module's package, and `importlib.import_module("tpkit....")` with a literal name.
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
    ("tpkit.data_parallel",),
    ("tpkit.checkpoint",),
    ("tpkit.convert",),
    ("tpkit.nn",),
    ("tpkit.distributed", "tpkit.launch"),
    ("tpkit.comm",),
]
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


def _dynamic_import(node: ast.Call) -> str | None:
    """`importlib.import_module(name)` or `__import__(name)` with a literal name (not relative)."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name not in ("import_module", "__import__") or not node.args:
        return None
    return _literal_prefix(node.args[0])


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
            target = _dynamic_import(node)
            targets = [target] if target else []
        found += [Import(node.lineno, t) for t in dict.fromkeys(targets) if t == ROOT or t.startswith(ROOT + ".")]
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
        theirs = layer_of(imp.target)
        if theirs is None:
            problems.append((imp.target, f"{path}:{imp.line} imports {imp.target}, which is in no layer; "
                                         f"add it to LAYERS in {__name__}"))
        elif theirs < mine:
            problems.append((imp.target, f"{path}:{imp.line} imports {imp.target}: {describe_layer(theirs)} is "
                                         f"above {module}'s {describe_layer(mine)}"))
    return problems


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


UPWARD = """
from __future__ import annotations

from ..comm import ReduceOp


def lazy():
    from ..convert import parallelize  # upward, and inside a function
    return parallelize
"""


def test_an_upward_import_is_reported_with_file_line_target_and_both_layers():
    problems = upward_imports(UPWARD, "tpkit.nn.linear", "src/tpkit/nn/linear.py")
    assert problems == [("tpkit.convert", "src/tpkit/nn/linear.py:8 imports tpkit.convert: layer 4 (tpkit.convert) "
                                          "is above tpkit.nn.linear's layer 5 (tpkit.nn)")]


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
    ("from ..comm.sharding import split_sizes", "tpkit.nn.partition"),
    ("from . import distributed", "tpkit.launch"),  # the same layer
    ("import tpkit\nfrom tpkit.convert import analyze", "tpkit.commands.demo"),
    ("import torch\nfrom torch import nn", "tpkit.comm.ops"),
])
def test_imports_down_or_sideways_are_not_reported(source, module):
    assert upward_imports(source, module, "x.py", known_modules=frozenset({"tpkit.distributed"})) == []


def test_a_module_in_no_layer_is_reported():
    assert "is in no layer" in upward_imports("", "tpkit.extras", "x.py")[0][1]
    assert "is in no layer" in upward_imports("import tpkit.extras", "tpkit.nn.linear", "x.py")[0][1]
