"""The site's API page (docs/reference/api.md) lists every public name of `tpkit`, `tpkit.comm` and `tpkit.nn`,
each in a table row with an example, and lists no name those modules do not have."""
from __future__ import annotations

import pathlib
import re
import types

import pytest

import tpkit

API_PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "reference" / "api.md"
MODULES = {"tpkit": tpkit, "tpkit.comm": tpkit.comm, "tpkit.nn": tpkit.nn}


def public_names(module: types.ModuleType) -> set[str]:
    """`__all__`, plus any other name without a leading underscore that the package defines or re-exports from
    tpkit (not a submodule, not a helper imported from elsewhere such as `typing.Any`)."""
    names = set(getattr(module, "__all__", ()))
    for name, value in vars(module).items():
        if name.startswith("_") or isinstance(value, types.ModuleType):
            continue
        if (getattr(value, "__module__", None) or "").startswith("tpkit"):
            names.add(name)
    return names


def api_tables() -> dict[str, list[tuple[set[str], str]]]:
    """For each `## \\`module\\`` heading of the API page: its table rows as (names in the first cell, example
    cell)."""
    tables: dict[str, list[tuple[set[str], str]]] = {}
    current = None
    for line in API_PAGE.read_text().splitlines():
        heading = re.match(r"## `([\w.]+)`", line)
        if heading:
            current = tables.setdefault(heading.group(1), [])
        elif line.startswith("|") and current is not None and not re.match(r"\|\s*(name|-+)\s*\|", line):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            names = set(re.findall(r"`([A-Za-z_]\w*)", cells[0]))
            current.append((names, cells[1] if len(cells) > 1 else ""))
    return tables


@pytest.mark.parametrize("module_name", list(MODULES))
def test_every_public_name_is_listed_with_an_example(module_name):
    tables = api_tables()
    assert module_name in tables, f"{API_PAGE.name} has no '## `{module_name}`' table"
    rows = tables[module_name]
    listed = set().union(*(names for names, _ in rows))
    missing = sorted(public_names(MODULES[module_name]) - listed)
    assert not missing, f"docs/reference/api.md does not list {module_name}: {', '.join(missing)}"
    for names, example in rows:
        assert "`" in example, f"no example for {sorted(names)}"


@pytest.mark.parametrize("module_name", list(MODULES))
def test_every_listed_name_exists(module_name):
    module = MODULES[module_name]
    for names, _ in api_tables()[module_name]:
        unknown = sorted(n for n in names if not hasattr(module, n))
        assert not unknown, f"docs/reference/api.md lists {module_name}.{unknown} which does not exist"
