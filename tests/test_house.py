"""The shape of the house (CONVENTIONS.md): small modules and functions, conversion steps that reach
architecture families only through the registry, and frozen records between the steps."""
from __future__ import annotations

import ast
import dataclasses
import pathlib
import re
import sys

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "tpkit"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80
STEPS = ("planning/planner", "planning/decide", "layouts", "validate", "swap", "parallelize", "steps", "state",
         "planning/dryrun")  # in convert/


def _sources():
    return sorted(SRC.rglob("*.py"))


def test_no_module_over_400_lines_and_no_function_over_80():
    problems = []
    for path in _sources():
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            problems.append(f"{path.relative_to(SRC)}: {lines} lines (at most {MAX_MODULE_LINES}): split the concept")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    problems.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name}: {n} lines "
                                    f"(at most {MAX_FUNCTION_LINES})")
    assert not problems, "\n".join(problems)


def family_imports(source: str) -> list[str]:
    """Imports of `convert/families/...` modules (or of the package itself) in `source`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            parts = (node.module or "").split(".")
            if "families" in parts or (not node.module and any(a.name == "families" for a in node.names)):
                out.append(f"line {node.lineno}: from {'.' * node.level}{node.module or ''} import ...")
        elif isinstance(node, ast.Import):
            out += [f"line {node.lineno}: import {a.name}" for a in node.names if "families" in a.name.split(".")]
    return out


@pytest.mark.parametrize("step", STEPS)
def test_conversion_steps_reach_families_only_through_the_registry(step):
    by_name = family_imports((SRC / "convert" / f"{step}.py").read_text())
    assert not by_name, f"convert/{step}.py imports a family by name ({by_name}); loop over registry.families()"


def test_a_step_importing_a_family_is_caught():
    assert family_imports("from .families.experts import FusedExpertsFamily\n") == [
        "line 1: from .families.experts import ..."]
    assert family_imports("from .registry import families\n") == []


def test_every_family_is_registered_and_every_style_is_a_style():
    from tpkit.convert.family import Family
    from tpkit.convert.registry import FAMILIES, STYLES
    from tpkit.convert.styles import Style

    modules = {p.stem for p in (SRC / "convert" / "families").glob("*.py")} - {"__init__"}
    registered = {type(f).__module__.rsplit(".", 1)[-1] for f in FAMILIES}
    assert modules <= registered, f"family modules not in registry.FAMILIES: {sorted(modules - registered)}"
    assert all(isinstance(f, Family) for f in FAMILIES)
    assert all(isinstance(s, Style) and s.name == name for name, s in STYLES.items())


def test_records_between_steps_are_frozen():
    from tpkit.convert.family import Checked, Choice, Planned, Proposal
    from tpkit.convert.families.sequence import SequenceRegion
    from tpkit.convert.peft.adapters import Adapters
    from tpkit.convert.roles import Pair, Role
    from tpkit.convert.state import ConversionState, Request
    from tpkit.convert.steps import Prepared
    from tpkit.convert.trace import Analysis, Call, Tag, Trace
    from tpkit.layout import HeadLayout, Piece, ShardLayout

    # (`Conversion` is the converted model's record, not a record between steps: it follows the model through
    # copies and data parallelism, `tpkit.nn.record`)
    for cls in (Adapters, Analysis, Call, Checked, Choice, ConversionState, HeadLayout, Pair, Piece, Planned,
                Prepared, Proposal, Request, Role, SequenceRegion, ShardLayout, Tag, Trace):
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, f"{cls.__name__} is not frozen"


def test_the_size_check_fails_on_a_long_function(tmp_path, monkeypatch):
    long = "def f():\n" + "    x = 1\n" * (MAX_FUNCTION_LINES + 1)
    (tmp_path / "big.py").write_text(long)
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    with pytest.raises(AssertionError, match="big.py:1 f: 82 lines"):
        test_no_module_over_400_lines_and_no_function_over_80()


# ---------------------------------------------------------------------------------------------------------------
# One mechanism per concept (issue 46): one module changes classes, one module touches a third-party library, no
# behaviour decided by what was imported first, one answer to "the communicator of this model".

def _modules_where(predicate) -> dict[str, list[int]]:
    """`{module path: [line, ...]}` of the AST nodes `predicate` accepts, over the package."""
    out: dict[str, list[int]] = {}
    for path in _sources():
        tree = ast.parse(path.read_text())
        lines = [n.lineno for n in ast.walk(tree) if predicate(n, tree)]
        if lines:
            out[str(path.relative_to(SRC))] = lines
    return out


def _assigns_class(node, tree) -> bool:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
        node, (ast.AugAssign, ast.AnnAssign)) else []
    return any(isinstance(t, ast.Attribute) and t.attr == "__class__" for t in targets)


def test_one_module_changes_the_class_of_a_module():
    found = _modules_where(_assigns_class)
    assert set(found) <= {"nn/rewrites.py"}, f"__class__ assigned outside nn/rewrites.py: {found}"


_ROOTS: dict[int, tuple[ast.AST, set[str]]] = {}  # id -> (the parsed module, kept alive so ids stay unique; roots)


def _third_party_roots(tree) -> set[str]:
    """Names a module binds to another package's modules or classes (its imports), once per parsed module."""
    if id(tree) in _ROOTS:
        return _ROOTS[id(tree)][1]
    roots = set()
    _ROOTS[id(tree)] = (tree, roots)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {(a.asname or a.name).split(".")[0] for a in node.names if not a.name.startswith("tpkit")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and not (node.module or "").startswith("tpkit"):
            roots |= {a.asname or a.name for a in node.names}
    return roots


def _patches(node, tree) -> bool:
    """An assignment to an attribute of another package's module or class (`nn.Module.x = ...`,
    `LoraModel.x = ...`, `module.PeftModel.x = ...`), or a change of `sys.meta_path`."""
    roots = _third_party_roots(tree)
    targets = node.targets if isinstance(node, ast.Assign) else []
    for t in targets:
        chain = []
        while isinstance(t, ast.Attribute):
            chain.append(t.attr)
            t = t.value
        if not chain or not isinstance(t, ast.Name):
            continue
        owners = [t.id] + chain[:0:-1]
        if t.id in roots and t.id not in ("self",) or any(o[:1].isupper() for o in owners[1:]) or t.id == "cls":
            return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("insert", "append") \
            and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "meta_path":
        return True
    return False


def test_one_module_changes_another_package():
    found = _modules_where(_patches)
    assert set(found) <= {"convert/peft/seam.py"}, f"another package's classes or modules changed outside the PEFT " \
                                                   f"seam: {found}"


def test_nothing_is_decided_by_what_was_imported_first():
    found = _modules_where(lambda n, tree: isinstance(n, ast.Compare) and any(
        isinstance(c, ast.Attribute) and c.attr == "modules" and isinstance(c.value, ast.Name) and c.value.id == "sys"
        for c in n.comparators))
    assert not found, f"`... in sys.modules` decides behaviour by import order: {found}"


def test_one_lookup_of_the_communicator_of_a_model():
    """Only `tpkit.nn.record.communicator_of` walks a model's modules for their communicator."""
    def walks_for_comm(node, tree) -> bool:
        if not isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            return False
        text = ast.unparse(node)
        return ".modules()" in text and ".comm" in text

    found = _modules_where(walks_for_comm)
    assert set(found) <= {"nn/record.py"}, f"a second lookup of a model's communicator: {found}"


def test_the_conversion_folder_shows_its_steps():
    flat = sorted(p.name for p in (SRC / "convert").glob("*.py"))
    assert len(flat) <= 20, f"convert/ holds {len(flat)} modules at its root (at most 20): group them by step"


def fake_mode_calls(source: str) -> list[int]:
    """Lines of `source` that make a `FakeTensorMode(...)` (by its name or as an attribute of a module)."""
    return [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
            and (getattr(node.func, "id", None) or getattr(node.func, "attr", None)) == "FakeTensorMode"]


def named_modules(docstring: str) -> set[str]:
    """The modules a package docstring lists: the first word of each indented line that starts with one."""
    return {m.group(1) for m in re.finditer(r"^ {4}([a-z_][a-z0-9_]*) {2,}\S", docstring, re.MULTILINE)}


def test_estimate_has_one_fake_run_and_its_docstring_names_every_module():
    """estimate/ makes fake tensors in one place (memory and speed read one traced run), and its package docstring
    says what each of its modules is for: every module listed, nothing listed that is not a module."""
    package = SRC / "estimate"
    sites = [f"{path.name}:{line}" for path in sorted(package.glob("*.py"))
             for line in fake_mode_calls(path.read_text())]
    assert len(sites) == 1 and sites[0].startswith("fake_step.py:"), (
        f"FakeTensorMode is made at {sites}: run the step through estimate/fake_step.py (trace_step, fake_tensors)")
    modules = {p.stem for p in package.glob("*.py")} - {"__init__"}
    named = named_modules(ast.get_docstring(ast.parse((package / "__init__.py").read_text())))
    assert not modules - named, f"estimate/__init__.py's docstring does not name {sorted(modules - named)}"
    assert not named - modules, f"estimate/__init__.py's docstring names modules that are gone: {sorted(named - modules)}"


def test_the_fake_run_and_docstring_checks_are_caught():
    assert fake_mode_calls("from torch._subclasses.fake_tensor import FakeTensorMode\n"
                           "with FakeTensorMode(allow_non_fake_inputs=True):\n    pass\n") == [2]
    assert fake_mode_calls("import torch\nmode = torch._subclasses.fake_tensor.FakeTensorMode()\n") == [2]
    assert fake_mode_calls("from x import FakeTensorMode\n# FakeTensorMode() in a comment\n") == []
    doc = "Title.\n\nGroup\n    speed       what it is for\n                more of it\n    hardware    datasheets\n"
    assert named_modules(doc) == {"speed", "hardware"}


# ---------------------------------------------------------------------------------------------------------------
# Private attributes tpkit keeps on modules (issue 46): each one read by the module that owns it and at most one
# other, so a fact about a module has one home and its readers can be found.

PRIVATE = re.compile(r"^_?tp_[a-z0-9_]+$")
#: `tp_plan` is the public record of a conversion's plan (CONVENTIONS.md); `_tp_plan` is transformers' own attribute
#: behind its `tp_plan` property
PUBLIC_MODULE_ATTRIBUTES = frozenset({"tp_plan", "_tp_plan"})


def _constants(tree) -> dict[str, str]:
    """Module-level names bound to a string (`_ATTR = "_tp_record"`)."""
    return {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
            and isinstance(n.value.value, str) for t in n.targets if isinstance(t, ast.Name)}


def kept_on_modules(source: str) -> set[str]:
    """The private attributes `source` keeps on objects (modules): the keys of `x.__dict__[...]`,
    `x.__dict__.get / pop / setdefault(...)`, `setattr / getattr / hasattr / delattr(x, ...)`, and the targets
    of `x.name = ...` other than on `self` / `cls`, named `tp_*` / `_tp_*`."""
    tree = ast.parse(source)
    consts = _constants(tree)

    def key(node) -> str | None:
        value = node.value if isinstance(node, ast.Constant) else consts.get(getattr(node, "id", None))
        return value if isinstance(value, str) and PRIVATE.match(value) else None

    def on_dict(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "__dict__"

    found = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Subscript) and on_dict(n.value):
            found.add(key(n.slice))
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and on_dict(n.func.value) and n.args \
                and n.func.attr in ("get", "pop", "setdefault"):
            found.add(key(n.args[0]))
        elif isinstance(n, ast.Call) and getattr(n.func, "id", None) in ("setattr", "getattr", "hasattr", "delattr") \
                and len(n.args) >= 2:
            found.add(key(n.args[1]))
        elif isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Attribute) and PRIVATE.match(t.attr) and getattr(t.value, "id", None) not in (
                        "self", "cls"):
                    found.add(t.attr)
    return {k for k in found if k and k not in PUBLIC_MODULE_ATTRIBUTES}


def mentions(source: str, name: str) -> bool:
    """Whether `source` reads or writes attribute `name` (as an attribute, or a string naming it)."""
    tree = ast.parse(source)
    return any((isinstance(n, ast.Attribute) and n.attr == name) or (isinstance(n, ast.Constant) and n.value == name)
               for n in ast.walk(tree))


def private_attribute_users(sources: dict[str, str]) -> dict[str, list[str]]:
    """`{attribute: [modules that mention it]}` for every private attribute some module keeps on a module."""
    names = set().union(*(kept_on_modules(s) for s in sources.values()))
    return {name: sorted(m for m, s in sources.items() if mentions(s, name)) for name in sorted(names)}


def test_each_private_module_attribute_has_its_owner_and_at_most_one_other_reader():
    sources = {str(p.relative_to(SRC)): p.read_text() for p in _sources()}
    users = private_attribute_users(sources)
    crowded = {name: mods for name, mods in users.items() if len(mods) > 2}
    assert not crowded, (f"private module attributes read by more than their owner and one other module: {crowded}; "
                         f"give the owner a function that answers the question and call it")
    assert "_tp_record" in users and "_tp_rewrites" in users  # the scan sees the attributes it is about


def test_the_private_attribute_scan_is_caught():
    owner = "_ATTR = '_tp_fact'\ndef put(m):\n    m.__dict__[_ATTR] = 1\n"
    readers = {f"r{i}.py": f"def get(m):\n    return m.__dict__.get('_tp_fact')\n" for i in range(2)}
    assert kept_on_modules(owner) == {"_tp_fact"}
    assert kept_on_modules("def f(m):\n    m.tp_flag = True\n    self.tp_x = 1\n") == {"tp_flag"}
    assert kept_on_modules("def f(m):\n    return getattr(m, 'tp_name', None), m.tp_plan\n") == {"tp_name"}
    assert private_attribute_users({"owner.py": owner, **readers}) == {"_tp_fact": ["owner.py", "r0.py", "r1.py"]}
