"""Tables fitted to a width: nothing cut inside a word, a number or a name part; columns left out are named;
piped output (no width) never wraps."""
from __future__ import annotations

import os
import pty

import pytest

from tpkit.tables import PIPE_WIDTH, Column, output_width, render_table

from tests.convert.rendered import assert_unbroken, rows, tables

NAMES = ["model.layers.*.self_attn.q_proj (x32)", "model.layers.*.post_attention_layernorm (x32)", "lm_head"]
REASON = "replicate: normalises over all features, so it needs the whole vector (0.4% of 1.5e9 parameters)"
COLUMNS = [Column("layer", "left", wrap="names"), Column("type", "left", drop=2), Column("params", drop=3),
           Column("per rank"), Column("style / reason", "left", wrap="words")]
ROWS = [[NAMES[0], "Linear", "16,777,216", "32.00 MiB", "colwise"],
        [NAMES[1], "LlamaRMSNorm", "4,096", "16.00 KiB", REASON],
        [NAMES[2], "Linear", "131,072,000", "250.00 MiB", "colwise_rep (tied to model.embed_tokens)"]]


def _check(text: str, width: int | None, kept: list[str]) -> None:
    """Every kept cell of ROWS is in the rendered table, whole, broken only between words or after a dot."""
    if width is not None:
        assert max(len(line) for line in text.splitlines()) <= width, text
    [(headers, lines)] = tables(text)
    assert headers == kept, text
    got = rows(lines, anchor=headers.index("per rank"))
    assert len(got) == len(ROWS), text
    for row, expected in zip(got, ROWS):
        for header, pieces in zip(headers, row):
            col = next(i for i, c in enumerate(COLUMNS) if c.header == header)
            assert_unbroken(expected[col], pieces, prose=COLUMNS[col].wrap == "words")
            if not COLUMNS[col].wrap:
                assert len(pieces) == 1, (header, pieces)


def test_no_width_keeps_every_column_and_never_wraps():
    text = render_table("plan", COLUMNS, ROWS, width=None)
    _check(text, None, [c.header for c in COLUMNS])
    for row in ROWS:  # each row on one line, every cell whole
        assert any(all(cell in line for cell in row) for line in text.splitlines()), row
    assert "left out" not in text


def test_80_columns_leave_out_the_least_important_columns_first():
    text = render_table("plan", COLUMNS, ROWS, width=80)
    _check(text, 80, ["layer", "per rank", "style / reason"])  # params (drop=3) went first, then type
    assert "left out to fit 80 columns: type, params" in " ".join(text.split())
    for name in NAMES:  # each module name still fits whole on one line (a count may go to the next)
        assert any(name.split(" (")[0] in line for line in text.splitlines()), name


@pytest.mark.parametrize("width", [100, 72, 60])
def test_narrower_widths_break_names_after_dots_and_prose_between_words(width):
    text = render_table("plan", COLUMNS, ROWS, width=width)
    kept = ["layer", "type", "per rank", "style / reason"] if width == 100 else ["layer", "per rank", "style / reason"]
    _check(text, width, kept)


def test_output_width_comes_from_columns_then_the_terminal_and_is_100_when_piped(monkeypatch, tmp_path):
    """$COLUMNS, else the terminal's width, else PIPE_WIDTH (100) for a file or a pipe; `wide` (--wide): None."""
    import fcntl
    import struct
    import termios

    monkeypatch.setenv("COLUMNS", "93")
    assert output_width() == 93 and output_width(wide=True) is None
    monkeypatch.delenv("COLUMNS")
    with open(tmp_path / "out.txt", "w") as f:
        assert output_width(f) == PIPE_WIDTH == 100 and output_width(f, wide=True) is None
    read_fd, write_fd = os.pipe()
    with os.fdopen(read_fd), os.fdopen(write_fd, "w") as w:
        assert output_width(w) == 100
    controller, terminal = pty.openpty()
    try:
        fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 71, 0, 0))
        with os.fdopen(terminal, "w", closefd=False) as tty:
            assert output_width(tty) == 71
    finally:
        os.close(controller)
        os.close(terminal)

