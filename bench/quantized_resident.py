"""What a quantized checkpoint's load holds on each rank (issue 55 item 5): a Qwen2 (hidden 256, intermediate 640,
vocabulary 1000, tied embeddings, 2 layers) quantized by compressed-tensors (int8 and int4 `pack-quantized` groups
of 128, symmetric; int4 asymmetric; FP8 per channel), saved from bf16 and from float32, loaded with
`tpkit.from_pretrained(path, comm=comm)` at 2 and 3 thread-ranks.

Per rank: `held`, the bytes of the unique tensors in `model.parameters()` and `model.buffers()` (stored tensors,
dense parameters, every non-persistent buffer: maps, product tables, rotary frequencies); `share`, the rank's share
of the stored bytes plus its replicated tensors (sum over state-dict keys, tied ones once, of
`shard_layouts(model)[k].local_numel` x the element size); their ratio (the goal: within 5%). Per world size:
`tpkit.analyze`'s and `tpkit.estimate_memory`'s per-rank parameter bytes against the fullest rank's `held`
without the buffers no layer's weight owns (the rotary embedding's frequencies, which neither counts).

    PYTHONPATH=src python bench/quantized_resident.py [--worlds 2,3] [--only int4]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

FORMATS = {
    "int8": dict(fmt="pack-quantized", num_bits=8, type="int", symmetric=True, strategy="group", group_size=128),
    "int4": dict(fmt="pack-quantized", num_bits=4, type="int", symmetric=True, strategy="group", group_size=128),
    "int4-asym": dict(fmt="pack-quantized", num_bits=4, type="int", symmetric=False, strategy="group",
                      group_size=128),
    "fp8": dict(fmt="float-quantized", num_bits=8, type="float", strategy="channel"),
}


def model(dtype: torch.dtype):
    import transformers as tr

    cfg = tr.Qwen2Config(vocab_size=1000, hidden_size=256, intermediate_size=640, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    return tr.Qwen2ForCausalLM(cfg).eval().to(dtype)


def held(m, skip: tuple[str, ...] = ()) -> int:
    """Bytes of the unique tensors `m` holds (parameters and buffers; buffers named with a part in `skip` left out)."""
    seen, total = set(), 0
    for name, t in list(m.named_parameters()) + list(m.named_buffers()):
        if t.device.type == "meta" or any(part in skip for part in name.split(".")):
            continue
        key = (t.data_ptr(), t.nbytes)
        if key not in seen:
            seen.add(key)
            total += t.nbytes
    return total


def share(m) -> int:
    import tpkit

    layouts, seen, total = tpkit.shard_layouts(m), set(), 0
    for k, t in m.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            total += layouts[k].local_numel * t.element_size()
    return total


def measure(path: str, world: int) -> list[tuple[int, int, int]]:
    import tpkit

    def body(comm):
        m = tpkit.from_pretrained(path, comm=comm, progress=False)
        return held(m), share(m), held(m, skip=("rotary_emb",))

    return tpkit.run_threads(body, world)


def sizing(path: str, dtype: torch.dtype, world: int) -> tuple[int, int]:
    """(analyze's, estimate_memory's) per-rank parameter bytes of the checkpoint at `world` ranks."""
    import transformers as tr

    import tpkit

    config = tr.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        meta = tr.AutoModelForCausalLM.from_config(config, dtype=dtype)
    report = tpkit.analyze(meta, world_size=world, max_world_size=world, device_memory="80GB")
    return report.per_rank_bytes[world], int(tpkit.estimate_memory(config, world, dtype=dtype).per_rank.parameters)


def main() -> None:
    from tests.quant.checkpoints import compressed_tensors

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2,3")
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    print(f"{'format':10} {'dtype':9} {'world':>5} {'rank':>4} {'held':>9} {'share':>9} {'held/share':>10}  "
          f"{'analyze/held':>12} {'estimate/held':>13}")
    worst = 0.0
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for dtype in (torch.bfloat16, torch.float32):
            base = model(dtype)
            for name, kw in FORMATS.items():
                if args.only and args.only not in name:
                    continue
                kw = dict(kw)
                path = compressed_tensors(base, f"{d}/{name}-{dtype}", kw.pop("fmt"), **kw)
                for world in worlds:
                    ranks = measure(path, world)
                    analyzed, estimated = sizing(path, dtype, world)
                    fullest = max(w for _, _, w in ranks)
                    for r, (h, s, _) in enumerate(ranks):
                        worst = max(worst, h / s)
                        tail = f"{analyzed / fullest:12.4f} {estimated / fullest:13.4f}" if r == 0 else ""
                        print(f"{name:10} {str(dtype)[6:]:9} {world:5} {r:4} {h:9} {s:9} {h / s:10.4f}  {tail}",
                              flush=True)
    print(f"largest held/share: {worst:.4f}")


if __name__ == "__main__":
    main()
