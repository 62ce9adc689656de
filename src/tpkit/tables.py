"""Text for people: one byte formatter (`format_bytes`) and one table renderer (`render_table`) for every
`summary()` and command, so sizes and tables read the same everywhere.

Tables stay readable at any width: `render_table(title, columns, rows, width)`.

`width=None` (the CLI's `--wide`) renders every column at its natural width and never wraps a cell. A given width
(a terminal's, `$COLUMNS`, or `PIPE_WIDTH` for a pipe or a file) is met by, in order: leaving out the least
important columns (each `Column.drop` says how soon; 0 = always shown), wrapping prose columns between words, and
breaking module names after a dot. A cell is never cut inside a word or a number. `output_width()` says which applies.
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys
import textwrap

WORDS_MIN = 20  # a prose column is not squeezed below this (or its longest word, if longer)
PIPE_WIDTH = 100  # tables written to a pipe or a file (no terminal, no $COLUMNS) fit this many columns
WIDE_HELP = (f"print tables at their natural width (default: fit the terminal, $COLUMNS, or {PIPE_WIDTH} columns "
             f"when piped)")


def format_bytes(n: float) -> str:
    """A byte count in binary units: `512 B`, `1.50 KiB`, ... `2.00 TiB`."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


@dataclasses.dataclass(frozen=True)
class Column:
    """One column: `justify` "left" or "right"; `drop` > 0 lets a narrow width leave it out (highest first);
    `wrap` "" never breaks a cell, "words" breaks prose between words, "names" breaks dotted names after a dot."""

    header: str
    justify: str = "right"
    drop: int = 0
    wrap: str = ""


def output_width(stream=None, wide: bool = False) -> int | None:
    """The width to fit tables to: None with `wide` (the CLI's `--wide`: no limit, nothing wraps), else `$COLUMNS`
    when set, the terminal's width when `stream` (default stdout) is a terminal, else `PIPE_WIDTH` (a pipe or a
    file: a table at its natural width can be hundreds of characters wide)."""
    if wide:
        return None
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    stream = sys.stdout if stream is None else stream
    try:
        if stream.isatty():
            return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        pass
    return PIPE_WIDTH


def wrap_text(text: str, width: int | None, indent: str = "", hanging: str = "") -> str:
    """A prose line: `indent + text`, wrapped between words at `width` with `hanging` before each further line
    (unwrapped when `width` is None)."""
    if width is None:
        return indent + text
    return textwrap.fill(text, width, initial_indent=indent, subsequent_indent=hanging, break_long_words=False,
                         break_on_hyphens=False)


def _tokens(text: str, wrap: str, width: int | None = None) -> list[tuple[str, str]]:
    """(piece, separator before it) pairs a cell may be broken between without cutting a word or a number:
    words, and for names (or a prose word longer than `width`) the parts of a dotted name, each ending in its
    dot. Prose never breaks after a dot followed by a digit, so 0.4% and 1.5e9 stay whole."""
    out = []
    for k, word in enumerate(text.split(" ")):
        if wrap == "names":
            parts = re.split(r"(?<=\.)", word)
        elif width is None or len(word) > width:
            parts = re.split(r"(?<=\.)(?=[^\d\s.])", word)
        else:
            parts = [word]
        out += [(p, " " if j == 0 and k > 0 else "") for j, p in enumerate(parts) if p]
    return out


def _fill(text: str, wrap: str, width: int) -> str:
    """`text` in lines of at most `width` (where its pieces allow), broken only between `_tokens`."""
    lines: list[str] = []
    line = ""
    for piece, sep in _tokens(text, wrap, width):
        if line and len(line) + len(sep) + len(piece) > width:
            lines.append(line)
            line = piece
        else:
            line += (sep if line else "") + piece
    return "\n".join(lines + [line])


def _extra(n: int) -> int:
    """Characters a rich box table adds around `n` columns: one border each side, one space of padding each side
    of a cell, one separator between columns."""
    return 3 * n + 1


def render_table(title: str, columns: list[Column], rows: list[list[str]], width: int | None = None) -> str:
    """The table as text fitted to `width` columns (None: natural width). Left-out columns are named in the
    caption."""
    from rich.cells import cell_len
    from rich.console import Console
    from rich.table import Table

    cells = [[str(c) for c in row] for row in rows]

    def natural(i: int) -> int:
        return max(cell_len(line) for text in [columns[i].header, *(r[i] for r in cells)] for line in
                   text.splitlines() or [""])

    def minimum(i: int, comfortable: bool = True) -> int:
        """The narrowest a column gets: its longest unbreakable piece; prose first stops at WORDS_MIN."""
        col = columns[i]
        if not col.wrap:
            return natural(i)
        longest = max((cell_len(p) for text in [col.header, *(r[i] for r in cells)] for p, _ in
                       _tokens(text, col.wrap)), default=1)
        return max(longest, min(natural(i), WORDS_MIN)) if col.wrap == "words" and comfortable else longest

    keep = list(range(len(columns)))
    widths = {i: natural(i) for i in keep}
    if width is not None:
        def needed(idx):  # names at full length; prose squeezed: first leave out columns, then break names
            return sum(natural(i) if columns[i].wrap != "words" else minimum(i) for i in idx) + _extra(len(idx))

        for i in sorted((i for i in keep if columns[i].drop > 0), key=lambda i: (-columns[i].drop, -i)):
            if needed(keep) <= width:
                break
            keep.remove(i)
        excess = sum(widths[i] for i in keep) + _extra(len(keep)) - width
        # then narrow prose, names, and prose below WORDS_MIN (widest first), a character at a time
        for kind, comfortable in (("words", True), ("names", True), ("words", False)):
            while excess > 0:
                shrinkable = [i for i in keep if columns[i].wrap == kind and widths[i] > minimum(i, comfortable)]
                if not shrinkable:
                    break
                widths[max(shrinkable, key=lambda i: widths[i])] -= 1
                excess -= 1
    dropped = [col.header for i, col in enumerate(columns) if i not in keep]
    table_width = sum(widths[i] for i in keep) + _extra(len(keep))
    title_width = cell_len(title) if width is None else min(cell_len(title), width)
    table = Table(title=title, min_width=max(title_width, table_width),
                  caption=f"left out to fit {width} columns: {', '.join(dropped)}" if dropped else None)
    for i in keep:
        # cells are broken here (`_fill`), not by rich; overflow="fold" only acts if even the narrowest layout
        # exceeds `width` (then letters fold, and none is lost)
        table.add_column(_fill(columns[i].header, columns[i].wrap or "words", widths[i]), justify=columns[i].justify,
                         width=widths[i], no_wrap=True, overflow="fold")
    for r in cells:
        table.add_row(*(_fill(r[i], columns[i].wrap, widths[i]) if columns[i].wrap and cell_len(r[i]) > widths[i]
                        else r[i] for i in keep))
    console = Console(width=width or max(title_width, table_width), record=True, file=_Null(), color_system=None,
                      force_terminal=False, highlight=False)
    console.print(table)
    return "\n".join(line.rstrip() for line in console.export_text(styles=False).rstrip("\n").splitlines())


class _Null:
    def write(self, *_):
        return 0

    def flush(self):
        pass
