"""Reading rendered box tables back: which cells a row holds and where each cell was broken across lines."""
from __future__ import annotations


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Each box table in `text` as (headers, body lines); a body line is its cells, stripped (`rows` groups the
    lines of one row)."""
    found, block = [], []
    for line in text.splitlines() + [""]:
        if line and line[0] in "┏┃┡│└":
            block.append(line)
        elif block:
            found.append(block)
            block = []
    out = []
    for block in found:
        head = [line for line in block if line.startswith("┃")]
        body = [line for line in block if line.startswith("│")]
        headers = [" ".join(p for p in parts if p) for parts in zip(*(_cells(line) for line in head))]
        out.append((headers, [_cells(line) for line in body]))
    return out


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line[1:-1].split("┃" if line.startswith("┃") else "│")]


def rows(lines: list[list[str]], anchor: int) -> list[list[list[str]]]:
    """Body lines grouped into rows: a row starts where column `anchor` (one that never wraps) is filled."""
    grouped: list[list[list[str]]] = []
    for cells in lines:
        if cells[anchor] or not grouped:
            grouped.append([[c] if c else [] for c in cells])
        else:
            for col, c in zip(grouped[-1], cells):
                if c:
                    col.append(c)
    return grouped


def assert_unbroken(expected: str, pieces: list[str], prose: bool = False) -> None:
    """`pieces` (a cell's lines) spell `expected`, broken only at a space or right after a dot (in prose, never
    after a dot followed by a digit: 0.4% stays whole): no word, number or name part is cut."""
    pos = 0
    for k, piece in enumerate(pieces):
        if k:
            if expected[pos:pos + 1] == " ":
                pos += 1
            else:
                assert expected[pos - 1] == "." and not (prose and expected[pos].isdigit()), \
                    f"{expected!r} broken inside a word: {pieces!r}"
        assert expected.startswith(piece, pos), f"{expected!r} is not rendered as {pieces!r}"
        pos += len(piece)
    assert pos == len(expected), f"{expected!r} lost its end: {pieces!r}"


def expected_rows(report) -> list[tuple[str, str, str]]:
    """(layer label, per-rank bytes, style / reason) of each row of an `AnalysisReport.summary()`."""
    from tpkit.tables import format_bytes as human

    out = []
    for name, count, r in report.grouped_layers():
        how = r.style if r.style != "replicate" else f"replicate: {r.reason}"
        how += f" (tied to {r.tied_to})" if r.tied_to else ""
        out.append((name if count == 1 else f"{name} (x{count})", human(r.bytes_per_rank), how))
    return out


def check_summary(text: str, report, width: int | None) -> list[str]:
    """Every layer row of `report` is in `text` (its summary, or `tpkit analyze`'s output) whole, every line
    within `width`; returns the plan table's headers."""
    from tpkit.tables import format_bytes as human

    if width is not None:
        assert max(len(line) for line in text.splitlines()) <= width, text
    (headers, lines), (mem_headers, mem_lines) = tables(text)
    per_rank = headers.index(f"per rank @{report.world_size}")
    got = rows(lines, anchor=per_rank)
    expected = expected_rows(report)
    assert len(got) == len(expected), text
    for row, (label, nbytes, how) in zip(got, expected):
        assert_unbroken(label, row[0])
        assert row[per_rank] == [nbytes]
        assert_unbroken(how, row[-1], prose=True)
    assert mem_headers == ["world size", "parameters", report.mode]
    assert [line[1] for line in mem_lines] == [human(report.per_rank_bytes[w]) for w in sorted(report.per_rank_bytes)]
    return headers
