"""The CLI reference page, generated from tpkit's own argparse parsers at build time (an MkDocs hook).

`mkdocs build` calls `on_files`, which adds `reference/cli.md` (never on disk, so never stale): for each
subcommand of `tpkit.cli.build_parser()`, its description, usage and a table of its arguments. Run as a script,
it prints the page: `PYTHONPATH=src python docs/hooks/cli_reference.py`.
"""
from __future__ import annotations

import argparse
import os
import pathlib

PAGE = "reference/cli.md"
EXAMPLES = pathlib.Path(__file__).with_name("cli_examples.md")  # hand-written examples, each line parsed by a test
WIDTH = "100"  # usage lines wrap here whatever the terminal


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _row(action: argparse.Action) -> str | None:
    if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
        return None
    if action.option_strings:
        name = ", ".join(f"`{s}`" for s in action.option_strings)
        if action.nargs != 0:
            name += f" `{action.metavar or action.dest.upper()}`"
    else:
        name = f"`{action.metavar or action.dest}`"
    if action.choices and not isinstance(action, argparse._SubParsersAction):
        choices = ", ".join(f"`{c}`" for c in action.choices)
    else:
        choices = ""
    default = action.default
    shown = "" if action.nargs == 0 or default in (None, argparse.SUPPRESS) or not action.option_strings \
        else f"`{default}`"
    help_text = _cell(action.help or "")
    if choices:
        help_text = f"{help_text} (one of {choices})".strip()
    return f"| {name} | {shown} | {help_text} |"


def render() -> str:
    """The page's markdown."""
    from tpkit.cli import SUBCOMMANDS, build_parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        parser = build_parser()
        lines = ["# Command line", "",
                 "Generated from the parsers in `src/tpkit/cli.py` and `src/tpkit/commands/` when the site is built "
                 "(`docs/hooks/cli_reference.py`), so it is what `tpkit COMMAND --help` prints. The command is "
                 "installed with tpkit as `tpkit`; `python -m tpkit.cli` is the same.", "",
                 "```text", parser.format_usage().strip(), "```", ""]
        lines += ["| command | what |", "|---|---|"]
        lines += [f"| [`tpkit {name}`](#tpkit-{name}) | {_cell(text)} |" for name, text in SUBCOMMANDS.items()]
        lines += ["", "## Examples", "", EXAMPLES.read_text().strip()]
        for name, sub in _subparsers(parser).items():
            lines += ["", f"## `tpkit {name}` {{#tpkit-{name}}}", "", _cell(sub.description or ""), "",
                      "```text", sub.format_usage().strip(), "```", ""]
            rows = [r for r in map(_row, sub._actions) if r]
            if rows:
                lines += ["| argument | default | what |", "|---|---|---|", *rows]
        return "\n".join(lines) + "\n"
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def on_files(files, config):  # MkDocs hook
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render()))
    return files


if __name__ == "__main__":
    print(render(), end="")
