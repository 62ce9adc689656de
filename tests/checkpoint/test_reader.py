"""The pieces under the loaders: byte runs of a box, who writes what, headers, progress off without a TTY."""
from __future__ import annotations

import torch

from tpkit.checkpoint.progress import Progress
from tpkit.checkpoint.reader import box_ranges
from tpkit.checkpoint.safetensors_file import read_header, read_ranges, write_file
from tpkit.checkpoint.save import owned_spans
from tpkit.layout import Piece, ShardLayout


def test_box_ranges_read_exactly_the_box(tmp_path):
    full = torch.arange(4 * 5 * 6, dtype=torch.float32).reshape(4, 5, 6)
    write_file(str(tmp_path / "f.safetensors"), {"x": full})
    header = read_header(str(tmp_path / "f.safetensors"))
    for box in [((1, 3), (0, 5), (0, 6)), ((0, 4), (2, 4), (0, 6)), ((1, 2), (1, 4), (2, 5)), ((0, 4), (0, 5), (3, 6))]:
        out = torch.empty([b - a for a, b in box])
        read_ranges(str(tmp_path / "f.safetensors"), header.tensors["x"], box_ranges(full.shape, box, 4), out)
        assert torch.equal(out, full[tuple(slice(a, b) for a, b in box)])


def test_layout_byte_ranges_give_the_shard(tmp_path):
    full = torch.randn(10, 7, dtype=torch.bfloat16)
    write_file(str(tmp_path / "f.safetensors"), {"x": full})
    info = read_header(str(tmp_path / "f.safetensors")).tensors["x"]
    for dim in (0, 1):
        for r in range(3):
            lay = ShardLayout.split(full.shape, dim, 3, r)
            out = torch.empty(lay.stored_local_shape, dtype=torch.bfloat16)
            read_ranges(str(tmp_path / "f.safetensors"), info, lay.byte_ranges(2), out)
            assert torch.equal(out, lay.shard(full))


def test_shared_kv_heads_are_written_once():
    # A piece every rank holds and one split: ranks 1 and 2 skip what rank 0 already wrote.
    lay = ShardLayout((6, 4), 3, 0, 0, (Piece(0, 2, ((0, 2),) * 3), Piece(2, 4, ((0, 2), (0, 2), (2, 4)))))
    written = [[(a, b) for a, b, _ in owned_spans(lay, r)] for r in range(3)]
    assert written == [[(0, 2), (2, 4)], [], [(4, 6)]]
    assert owned_spans(ShardLayout.replicated((3,), 2, 1), 1) == []


def test_progress_is_off_without_a_tty():
    with Progress("x", 10) as bar:
        bar.advance(5)
        assert not bar.enabled


def test_progress_true_without_a_terminal_writes_a_line_per_tenth(tmp_path, capsys):
    """Forced on into a log file (captured stderr is no terminal): plain lines, the last at 100%, no blank ones."""
    import tpkit
    from tests.models.hf import hf_model

    hf_model("llama").save_pretrained(tmp_path)
    capsys.readouterr()
    tpkit.from_pretrained(str(tmp_path), progress=True)
    lines = capsys.readouterr().err.splitlines()
    ours = [line for line in lines if line.startswith(f"loading {tmp_path.name}: ")]
    assert 1 <= len(ours) <= 10 and "100%" in ours[-1], lines
    assert all(line.strip() for line in lines), lines


def test_progress_lines_step_by_tenths(tmp_path):
    with open(tmp_path / "log", "w") as log:
        with Progress("saving", 1000, True, stream=log) as bar:
            for _ in range(40):
                bar.advance(25)
    lines = (tmp_path / "log").read_text().splitlines()
    assert [line.split(":")[1].split("%")[0].strip() for line in lines] == [str(10 * i) for i in range(1, 11)]


def test_from_pretrained_imports_only_the_models_own_transformers_modules(tmp_path):
    """In a fresh process, the first from_pretrained imports from transformers.models only the auto mappings
    and the model's own family (no other architecture), and nothing beyond what importing its class does."""
    import json
    import subprocess
    import sys

    from tests.models.hf import hf_model

    hf_model("llama").save_pretrained(tmp_path)
    code = ("import json, sys, tpkit; tpkit.from_pretrained(sys.argv[1]); "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('transformers'))))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    families = {".".join(m.split(".")[:3]) for m in loaded if m.startswith("transformers.models.")}
    assert families == {"transformers.models.auto", "transformers.models.llama"}, families
    code = ("import json, sys, torch, transformers; from transformers.models.llama import modeling_llama; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('transformers'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert not loaded - set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_scatter_reads_a_column_block_into_its_rows_with_one_positional_read(tmp_path):
    """A piece saved at TP 2 by columns, read into a TP 1 region (and a block of it into a TP 3 one): one read
    per file run, scattered over the region's rows, no temporary; every region matches the full tensor."""
    from tpkit.checkpoint.reader import Copy, fill, scatter
    from tpkit.checkpoint.sources import Piece as StoredPiece

    full = torch.arange(6 * 10, dtype=torch.float32).reshape(6, 10)
    write_file(str(tmp_path / "f.safetensors"), {"a": full[:, :5].contiguous(), "b": full[:, 5:].contiguous()})
    header = read_header(str(tmp_path / "f.safetensors"))
    for name, col in (("a", 0), ("b", 5)):
        info = header.tensors[name]
        piece = StoredPiece(str(tmp_path / "f.safetensors"), name, (0, col), (6, 5))
        copy = Copy(piece, info, ((info.start, info.stop),), (0, col), (6, 5), True)
        plan = scatter(copy, (6, 10), 4)
        assert len(plan) == 1 and len(plan[0][1]) == 6  # one read, six rows
        region = torch.zeros(6, 10)
        fill(copy, region)
        assert torch.equal(region[:, col:col + 5], full[:, col:col + 5])
    info = header.tensors["b"]  # columns 6..8 of the full tensor: 1..3 of piece b, into a (6, 3) region
    runs = tuple((info.start + a, info.start + b) for a, b in box_ranges((6, 5), ((0, 6), (1, 4)), 4))
    region = torch.zeros(6, 3)
    fill(Copy(StoredPiece(str(tmp_path / "f.safetensors"), "b", (0, 5), (6, 5)), info, runs, (0, 0), (6, 3), False),
         region)
    assert torch.equal(region, full[:, 6:9])
