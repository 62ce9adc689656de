"""Greedy decode at TP2 (`--world N`: TPN) of one model in five formats: float32, bf16, and compressed-tensors int8 per channel (W8A16),
int4 group 128 (W4A16) and FP8 per channel of the bf16 model; each against float32 and against the memory limit.

A random Llama is drawn from `--seed` (hidden, MLP width, layers; head dim 128, 4 query heads per KV head,
vocabulary 8000; the seed and shape are printed; `--issue-shape` takes issue 47's: hidden 2048, MLP 5632, 8
layers), saved as float32 and bf16, and the bf16 model quantized by compressed-tensors (llm-compressor's W8A16 /
W4A16 / FP8 presets: int8 channel and int4 group 128 symmetric `pack-quantized`, FP8 channel `float-quantized`; the
LM head left dense bf16, as they do). In 2 gloo processes (`tpkit.launch`, one thread each), each rank loads all
five with `tpkit.from_pretrained` (each at its checkpoint's dtype) and times their greedy decode alternately:
ms/token = (generate N tokens - generate 1) / (N - 1), the median of `--repeats` rounds. The memory limit of a
format is the bytes a rank reads per token (every tensor it holds, less the embedding table it reads one row of)
over the streaming bandwidth a rank gets while the other streams too (measured here: both ranks summing a 512 MiB
float32 tensor at once). Prints a markdown block for BENCHMARKS.md, with the load average. This box's
bandwidth drifts by a third within minutes, so the bandwidth is measured again before each format's turn in each
round and each turn's ms/token set against that moment's limit ("/ limit, each turn's bandwidth": the median over
rounds). The floor is a Llama of the same depth at hidden 128 (float32 and bf16) loaded by plain transformers and
timed in the same turns: the per-token cost of transformers' eager forward and `generate` alone; "less the floor" is
the ratio with the float32 floor taken off every format, what the products and tpkit's own code cost against the
limit (the bf16 floor is printed, not taken off: see `make_floor`). `--compile` also times
each format with its forward under `torch.compile` (eager and compiled alternating on the same model, each format
in its own launch): what the per-token Python costs; with `--static`, compiled as transformers compiles a decode
(a static cache, the forward compiled by `generate`), the float32 floor too. `--threads N`: torch threads per rank
(default 1; the products split their rows over them): `--world 1 --threads 2` is one rank owning both cores.

    python bench/quantized.py [--seed N] [--issue-shape] [--tokens 9] [--repeats 5] [--world 1] [--threads 2]
                              [--compile]
    python bench/quantized.py --kernels [--hidden 2048] [--threads 1] [--world 1]   # one MLP-sized layer, batch 1
    python bench/quantized.py --formats                   # exactness and bytes per format, 2 and 3 thread-ranks

`--kernels` times one decode product of an MLP-sized layer (`out` = 2.75 x hidden, `in` = hidden) by each path a
layer can take: its weights rotated over more than the last-level cache, as a model's are ("GB/s of weight"), and one
copy called again ("hot": what the path computes at where the weight fits the cache, its memory aside), with the
streaming rate of the same rounds beside them. `--world N` runs it in N processes at once, a barrier before each
timing: each rank's share of the memory when all stream, as at TPN.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VOCAB = 8000


FORMATS = ("float32", "bf16", "int8", "int4", "fp8")


def draw(seed: int, issue: bool) -> dict:
    """A Llama shape drawn from `seed` (or issue 47's)."""
    if issue:
        return {"hidden": 2048, "mlp": 5632, "layers": 8}
    rng = random.Random(seed)
    hidden = rng.choice([1536, 2048, 2304, 2560])
    return {"hidden": hidden, "mlp": int(hidden * rng.uniform(2.5, 3.5)) // 256 * 256, "layers": rng.randint(4, 8)}


def heads_of(shape: dict) -> tuple[int, int]:
    """(attention heads of 128, KV heads: about a quarter, dividing the heads: 18 -> 3)."""
    heads = shape["hidden"] // 128
    return heads, next(k for k in range(max(heads // 4, 1), 0, -1) if heads % k == 0)


def make(directory: str, shape: dict, device: str = "cpu") -> dict[str, str]:
    """The five checkpoints of one random Llama of `shape`, by format (drawn and quantized on `device`)."""
    import transformers as tr

    from tests.quant.checkpoints import compressed_tensors

    heads, kv_heads = heads_of(shape)
    config = tr.LlamaConfig(vocab_size=VOCAB, hidden_size=shape["hidden"], intermediate_size=shape["mlp"],
                            num_hidden_layers=shape["layers"], num_attention_heads=heads,
                            num_key_value_heads=kv_heads, max_position_embeddings=256)
    torch.manual_seed(0)
    with torch.device(device):
        model = tr.LlamaForCausalLM(config).eval()
    out = {f: os.path.join(directory, f) for f in FORMATS}
    model.save_pretrained(out["float32"])
    model = model.to(torch.bfloat16)
    model.save_pretrained(out["bf16"])
    compressed_tensors(model, out["int8"], "pack-quantized", num_bits=8, type="int", symmetric=True,
                       strategy="channel")
    compressed_tensors(model, out["int4"], "pack-quantized", num_bits=4, type="int", symmetric=True, strategy="group",
                       group_size=128)
    compressed_tensors(model, out["fp8"], "float-quantized", num_bits=8, type="float", strategy="channel")
    return out


FLOOR_WIDTH = 128  # the floor model's hidden size: one head of 128, its weights a few MiB


def make_floor(directory: str, shape: dict) -> dict[str, str]:
    """A Llama of `shape`'s depth at hidden `FLOOR_WIDTH` (MLP twice that, vocabulary `VOCAB`), in float32 and in
    bf16: what a token costs transformers' own eager forward and `generate` when the products read next to nothing.
    The float32 floor is the one taken off: its 57 products per token cost ~9 us each, about what any product's call
    costs. The bf16 floor is printed only: torch's bf16 product at this width costs 17-34 us a call (1-2 ms a token
    on the 2-core EPYC), a product the formats' models do not run (theirs are tpkit's, counted against the limit),
    so taking it off flattered every bf16-computing format by about that much (the twelfth session's table did).
    Its LM head (`VOCAB` x `FLOOR_WIDTH`, 4 MiB in float32) is still read every token, ~0.2 ms at this box's rates,
    which the formats' limits count as well: "less the floor" takes off that much too many."""
    import transformers as tr

    config = tr.LlamaConfig(vocab_size=VOCAB, hidden_size=FLOOR_WIDTH, intermediate_size=2 * FLOOR_WIDTH,
                            num_hidden_layers=shape["layers"], num_attention_heads=FLOOR_WIDTH // 128,
                            num_key_value_heads=1, max_position_embeddings=256)
    torch.manual_seed(0)
    model = tr.LlamaForCausalLM(config).eval()
    out = {}
    for dtype in ("float32", "bf16"):
        out[dtype] = os.path.join(directory, dtype)
        model.to(torch.bfloat16 if dtype == "bf16" else torch.float32).save_pretrained(out[dtype])
    return out


def ms_per_token(model, tokens: int, **generate) -> float:
    """Greedy decode's ms/token: `generate` of `tokens` less that of 1, over the tokens between (`generate`: more
    keywords for it, as `static_compiled()`'s)."""
    ids = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))

    def run(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **generate)
        return time.perf_counter() - start

    return (run(tokens) - run(1)) / (tokens - 1) * 1e3


def static_compiled() -> dict:
    """`generate`'s keywords for transformers' own fast decode: a static cache (its tensors made once, every step
    the same shapes) and the forward compiled by `generate` itself (`CompileConfig`: inductor, whole graph; on the CPU
    too, which transformers does only where asked, `_compile_all_devices`)."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True, dynamic=False, mode="default")
    config._compile_all_devices = True
    return {"cache_implementation": "static", "compile_config": config}


def bytes_per_token(model) -> int:
    """The bytes a rank reads per decoded token: every tensor it holds, less the input embedding table (one row of
    it is read; the table counts when it is the LM head's weight too)."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and "weight" in head._parameters and head._parameters["weight"] is embedding
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return total if tied else total - embedding.numel() * embedding.element_size() + embedding[0].nbytes


_STREAMED: list = []  # the tensor `streaming` sums, made once per process


def streaming(seconds: float = 1.0) -> float:
    """Bytes per second this rank reads from memory while the other ranks do the same (a float32 sum over 512 MiB,
    after a barrier)."""
    import tpkit

    if not _STREAMED:
        _STREAMED.append(torch.ones(128 * 2 ** 20))
    t = _STREAMED[0]
    t.sum()
    comm = tpkit.get_communicator()
    rates = []
    for _ in range(5):
        comm.barrier()
        start, n = time.perf_counter(), 0
        while time.perf_counter() - start < seconds / 5:
            t.sum()
            n += 1
        rates.append(n * t.nbytes / (time.perf_counter() - start))
    return statistics.median(rates)


def _tp_rank(paths: dict, tokens: int, repeats: int, compiled: bool = False, floor: dict | None = None,
             threads: int = 1, static: bool = False) -> dict:
    """One rank's figures. `compiled`: each model is also timed with its forward under `torch.compile` (inductor,
    dynamic shapes), eager and compiled alternating on the same loaded model, the compile's seconds recorded;
    `static`: compiled instead as transformers compiles a decode (`static_compiled`), the floor models too.
    Before each format's turn in a round, the streaming bandwidth is measured again (0.2 s): this box's bandwidth
    drifts by a third within minutes, so each turn's ms/token is set against the limit of that moment
    (`ratio_<format>`: the median over rounds). `floor`: checkpoints (by dtype) of the same depth at a small width,
    loaded by plain transformers in this process (no tpkit, no communication) and timed in the same turns: the
    per-token cost of transformers' own eager forward and `generate`, which no product can remove. `threads`: torch's
    intra-op threads in this rank (its products split over them; the streaming rate is read with as many)."""
    import tpkit

    torch.set_num_threads(threads)
    out = {"bandwidth": streaming()}
    models = {}
    for name, path in paths.items():
        start = time.perf_counter()
        models[name] = tpkit.from_pretrained(path, progress=False)
        out[f"load_{name}"] = time.perf_counter() - start
        out[f"bytes_{name}"] = bytes_per_token(models[name])
    for dtype, path in (floor or {}).items():
        import transformers as tr

        models[f"floor_{dtype}"] = tr.AutoModelForCausalLM.from_pretrained(path, dtype="auto").eval()
    ways = {n: {"eager": (m.forward, {})} for n, m in models.items()}  # a way: (the forward, generate's keywords)
    if compiled:  # a rank compiles one model (`main` launches each format apart): never eager past the limit
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    for n, m in models.items():
        ms_per_token(m, 3)  # warm-up
        if compiled and (static or not n.startswith("floor")):
            start = time.perf_counter()
            ways[n]["compiled"] = (m.forward, static_compiled()) if static else (
                torch.compile(m.forward, dynamic=True), {})
            m.forward = ways[n]["compiled"][0]
            ms_per_token(m, tokens, **ways[n]["compiled"][1])  # compiles the prefill's and the decode step's graphs,
            # at both lengths timed (a static cache is as long as the generation: each length is a graph of its own)
            out[f"compile_{n}"] = time.perf_counter() - start
    samples = {(n, way): [] for n in models for way in ways[n]}
    ratios = {key: [] for key in samples}
    for _ in range(repeats):
        for (n, way), seen in samples.items():  # alternating
            bandwidth = streaming(0.2)
            models[n].forward, generate = ways[n][way]
            seen.append(ms_per_token(models[n], tokens, **generate))
            if not n.startswith("floor"):
                ratios[n, way].append(seen[-1] / (out[f"bytes_{n}"] / bandwidth * 1e3))
            out.setdefault("bandwidths", []).append(bandwidth)
    out.update({f"decode_{n}" if way == "eager" else f"compiled_{n}": statistics.median(v)
                for (n, way), v in samples.items()})
    out.update({f"ratio_{n}" if way == "eager" else f"compiled_ratio_{n}": statistics.median(v)
                for (n, way), v in ratios.items() if v})
    return out


def kernels(hidden: int, repeats: int = 20, threads: int = 1) -> dict:
    """One MLP-sized layer's decode product (batch 1) by each path, in ms: `cold`, each call the next of copies
    rotated over more bytes than the last-level cache (as a model's weights stream from memory); `hot`, one copy
    called again and again (where it fits the last-level cache, 32 MB on the 2-core EPYC: every format but float32,
    bf16 just: what the path computes at, its memory aside). Under `tpkit.launch` every rank runs it, a barrier
    before each timing, so the ranks' products stream at once, as at TPN. `stream`: this rank's streaming rate in
    the same rounds (`streaming`: a float32 sum, every rank at once)."""
    from tpkit.quant import native
    from tpkit.quant.kernels import int4_kernel_block, int4_kernel_layout

    import tpkit

    comm = tpkit.get_communicator()
    torch.set_num_threads(threads)
    O, I, g = int(hidden * 2.75) // 128 * 128, hidden, 128
    gen = torch.Generator().manual_seed(0)
    copies = max(2, 96 * 2 ** 20 // (O * I))  # the weights rotated: more bytes than the last-level cache
    x = torch.randn(1, I, generator=gen).bfloat16()
    w32 = [torch.randn(O, I, generator=gen) for _ in range(copies)]
    wbf = [w.bfloat16() for w in w32]
    q8 = [torch.randint(-127, 127, (O, I), dtype=torch.int8, generator=gen) for _ in range(copies)]
    s8 = torch.rand(O, 1, generator=gen)
    p4 = [torch.randint(-2 ** 31, 2 ** 31 - 1, (O, I // 8), dtype=torch.int32, generator=gen) for _ in range(copies)]
    t4 = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (O, I), dtype=torch.int32,
                                                                            generator=gen), 1) for _ in range(copies)]
    s4, sz = torch.rand(O, I // g, generator=gen).bfloat16(), torch.rand(I // g, O, 2).bfloat16()  # as loaded
    s8f = w32[0].abs().amax(1, keepdim=True) / 448  # per channel, as a checkpoint's FP8 fills the format's range
    f8 = [(w / s8f).to(torch.float8_e4m3fn) for w in w32]  # (unscaled randn: ~1% subnormals, each added apart)
    calls = {"float32 F.linear": (lambda k: torch.nn.functional.linear(x.float(), w32[k]), 4),
             "bf16 F.linear": (lambda k: torch.nn.functional.linear(x, wbf[k]), 2),
             "torch _weight_int8pack_mm (bf16 x)": (lambda k: torch.ops.aten._weight_int8pack_mm(
                 x, q8[k], s8[:, 0].bfloat16()), 1),
             "torch _weight_int4pack_mm_for_cpu (bf16 x, layout kept)": (
                 lambda k: torch.ops.aten._weight_int4pack_mm_for_cpu(x, t4[k], g, sz), 0.5),
             "torch int4 with the layout rebuilt per call": (lambda k: torch.ops.aten._weight_int4pack_mm_for_cpu(
                 x, int4_kernel_layout(p4[k], int4_kernel_block()), g, sz), 0.5)}
    if native.available():
        calls.update({"tpkit native float32": (lambda k: native.gemv(x.float(), w32[k], "fp32", O), 4),
                      "tpkit native bf16": (lambda k: native.gemv(x, wbf[k], "bf16", O), 2),
                      "tpkit native int8": (lambda k: native.gemv(x, q8[k], "int8", O, s8, None, (1, I)), 1),
                      "tpkit native int4 g128": (lambda k: native.gemv(x, p4[k], "uint4", O, s4, None, (1, g), 8),
                                                 0.5),
                      "tpkit native FP8 channel": (lambda k: native.gemv(x, f8[k], "fp8", O, s8f, None, (1, I)), 1)})

    def timed(f, rotate: bool) -> float:
        f(0)
        comm.barrier()
        start = time.perf_counter()
        for i in range(repeats):
            f((i + 1) % copies if rotate else 0)
        return (time.perf_counter() - start) / repeats * 1e3

    times, streams = {}, []
    for _ in range(5):  # alternating rounds, the median of each
        streams.append(streaming(0.2))
        for name, (f, _b) in calls.items():
            times.setdefault((name, "cold"), []).append(timed(f, True))
            times.setdefault((name, "hot"), []).append(timed(f, False))
    return {"shape": (O, I), "copies": copies, "threads": threads, "stream": statistics.median(streams),
            "bytes": {n: O * I * b for n, (_f, b) in calls.items()},
            "ms": {key: statistics.median(v) for key, v in times.items()}}


def kernels_table(ranks: list[dict]) -> str:
    """`kernels`' figures as a markdown block: each path's ms (the slowest rank's), its GB/s of weight from memory
    and in cache (the range over ranks where several ran at once) and the streaming rate beside them."""
    r0 = ranks[0]
    O, I = r0["shape"]

    def rate(n: str, way: str) -> str:
        got = [x["bytes"][n] / x["ms"][n, way] / 1e6 for x in ranks]
        return f"{min(got):.1f}" if len(got) == 1 else f"{min(got):.1f}-{max(got):.1f}"

    base = max(x["ms"]["float32 F.linear", "cold"] for x in ranks)
    rows = []
    for n in r0["bytes"]:
        ms = max(x["ms"][n, "cold"] for x in ranks)
        rows.append(f"| {n} | {ms:.3f} | {rate(n, 'cold')} | {ms / base:.2f}x | {rate(n, 'hot')} |")
    streams = [x["stream"] / 1e9 for x in ranks]
    each = f"{min(streams):.1f}" if len(ranks) == 1 else f"{min(streams):.1f}-{max(streams):.1f} per rank"
    who = "" if len(ranks) == 1 else f" in each of {len(ranks)} processes at once"
    threads = r0["threads"]
    return "\n".join([f"One layer [{O} x {I}], batch 1, {threads} thread{'s' if threads > 1 else ''}{who}, "
                      f"{r0['copies']} weights rotated (cold) or one called again (hot); streaming (a float32 sum, "
                      f"in the same rounds): {each} GB/s:", "",
                      "| call | ms | GB/s of weight | / float32 | GB/s hot |", "|---|---|---|---|---|"] + rows)


def formats() -> str:
    """Per format of tests/quant (the checkpoints made the ecosystem's way): the worst logits error against
    transformers' load of the directory, whether every rank's dequantized weight is the exact slice, and the
    quantized tensors' bytes a rank holds over the file's bytes of those layers times the rank's share of each dense
    weight (1.0: no overhead beyond the split itself; the worst rank)."""
    import tpkit
    from tpkit.comm import run_threads
    from tpkit.nn.quantized import quant_method_of
    from tests.quant import test_checkpoints as T

    rows = ["| format | ranks | logits rel err | weights exact | stored bytes / its dense share of the file's | kernel |",
            "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        bases = {"llama": T.C.llama(), "qwen2": T.C.qwen2(), "phi3": T.C.phi3()}
        made: dict[str, tuple[str, str | None]] = {}

        def directory(name: str) -> str:
            if name not in made:
                model, maker = T.FORMATS[name]
                made[name] = maker(os.path.join(tmp, name), bases[model], directory)
            return made[name][0]

        for name in sorted(T.FORMATS):
            d = directory(name)
            ref = T.C.reference(d, made[name][1])
            with torch.no_grad():
                want = ref(T.IDS).logits
            dense = ref.state_dict()
            for world in (2, 3):
                def body(comm):
                    model = tpkit.from_pretrained(d, comm=comm, progress=False)
                    with torch.no_grad():
                        err = T._rel(model(T.IDS).logits, want)
                    exact, local, full, kernels = True, 0, 0, set()
                    for n, m in model.named_modules():
                        st = quant_method_of(m)
                        if st is not None:
                            exact &= torch.equal(m.weight, st.dense.shard(dense[f"{n}.weight"]))
                            kernels.add(st.kernel)
                            share = st.dense.local_numel / torch.Size(st.dense.full_shape).numel()
                            for s in st.specs:
                                t = m._buffers[s]
                                local += t.numel() * t.element_size()
                                full += torch.Size(st.specs[s].shape).numel() * t.element_size() * share
                    return err, exact, local / full, kernels

                res = run_threads(body, world)
                kern = sorted({k for r in res for k in r[3] if k}) or ["-"]
                rows.append(f"| {name} | {world} | {max(r[0] for r in res):.1e} | "
                            f"{'yes' if all(r[1] for r in res) else 'NO'} | {max(r[2] for r in res):.3f} | "
                            f"{', '.join(kern)} |")
    return "\n".join(rows)


def main() -> None:
    import tpkit

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=None, help="the shape's seed (default: drawn now, printed)")
    ap.add_argument("--issue-shape", action="store_true", help="issue 47's Llama: hidden 2048, MLP 5632, 8 layers")
    ap.add_argument("--hidden", type=int, default=2048, help="--kernels: the layer's input features")
    ap.add_argument("--tokens", type=int, default=9)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--world", type=int, default=None, help="tensor-parallel ranks (gloo processes), default 2; "
                    "--kernels: processes timing the layer at once, default 1")
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--formats", action="store_true")
    ap.add_argument("--compile", action="store_true", help="also time each format's forward under torch.compile")
    ap.add_argument("--static", action="store_true", help="with --compile: compiled as transformers compiles a "
                    "decode (a static cache, CompileConfig), the float32 floor too")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1; --world 1 --threads 2 "
                    "gives one rank both cores of a 2-core box)")
    args = ap.parse_args()
    if args.kernels:
        world = args.world or 1
        print(kernels_table([kernels(args.hidden, threads=args.threads)] if world == 1 else
                            tpkit.launch(kernels, world, timeout=3600, args=(args.hidden, 20, args.threads))))
        return
    args.world = args.world or 2
    if args.formats:
        print(formats())
        return
    seed = args.seed if args.seed is not None else int(time.time()) % 10000
    shape = draw(seed, args.issue_shape)
    print(f"seed {seed}: {shape}", flush=True)
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        paths = make(tmp, shape)
        floor = make_floor(os.path.join(tmp, "floor"), shape) if args.static or not args.compile else None
        if args.compile:  # one format per launch: models compiled side by side share their forward's compiled code,
            # whose guards every call then checks for all of them (the int4 step ran 1.2x eager that way)
            ranks = [{} for _ in range(args.world)]
            for f in FORMATS:
                for mine, got in zip(ranks, tpkit.launch(_tp_rank, args.world, timeout=3600,
                                                         args=({f: paths[f]}, args.tokens, args.repeats, True,
                                                               {"float32": floor["float32"]} if args.static else None,
                                                               args.threads, args.static))):
                    mine.update({k: v for k, v in got.items() if not k.startswith("bandwidth")})
                    mine[f"floor_of_{f}"] = got.get("compiled_floor_float32")  # (--static: timed in its turns)
                    mine[f"bandwidth_{f}"] = got["bandwidth"]
                    mine.setdefault("bandwidths", []).extend(got["bandwidths"])
        else:
            ranks = tpkit.launch(_tp_rank, args.world, timeout=3600,
                                 args=(paths, args.tokens, args.repeats, False, floor, args.threads))
    load = max(load[0], os.getloadavg()[0])
    r = {k: max(x[k] for x in ranks) for k in ranks[0] if not k.startswith("bandwidth")}
    turns = [b for x in ranks for b in x["bandwidths"]]
    bws = {f: min(x.get(f"bandwidth_{f}", x.get("bandwidth")) for x in ranks) for f in FORMATS}  # each launch's own
    bw = min(bws.values())
    rows = []
    floor, floor_bf16 = r.get("decode_floor_float32"), r.get("decode_floor_bf16")
    for f in FORMATS:
        limit = r[f"bytes_{f}"] / bws[f] * 1e3
        paired = r.get(f"ratio_{f}")
        beyond = "" if floor is None else f" {paired * (r[f'decode_{f}'] - floor) / r[f'decode_{f}']:.2f}x |"
        rows.append(f"| {f} | {r[f'decode_{f}']:.1f} | {r[f'decode_{f}'] / r['decode_float32']:.2f}x | "
                    f"{r[f'bytes_{f}'] / 2 ** 20:.0f} MiB | {limit:.1f} | {r[f'decode_{f}'] / limit:.2f}x | "
                    f"{'' if paired is None else f'{paired:.2f}x'} |{beyond} {r[f'load_{f}']:.1f} |")
    table = "\n".join(["| format | decode ms/token | / float32 | read per rank per token | memory limit ms | "
                       "/ limit | / limit, each turn's bandwidth |" + (" the same less the floor |" if floor else "")
                       + " load s |", "|---|---|---|---|---|---|---|" + ("---|" if floor else "") + "---|"] + rows)
    if floor is not None:
        table += (f"\n\nFloor: transformers' own eager `generate` of the same {shape['layers']} layers at hidden "
                  f"{FLOOR_WIDTH} (one process per rank, no tpkit, no communication), timed in the same turns: "
                  f"{floor:.2f} ms/token in float32 (taken off every format)"
                  + ("" if floor_bf16 is None else f", {floor_bf16:.2f} in bf16 (not taken off: most of it is torch's "
                     f"bf16 product at that width, which no format here runs)") + ". Streaming "
                  f"per rank measured before each turn: "
                  f"{min(turns) / 1e9:.1f}-{max(turns) / 1e9:.1f} GB/s.")
    if args.compile:
        floored = r.get("compiled_floor_float32")  # (--static: the floor compiled the same way, in each launch)

        def less_floor(f: str) -> float:  # the ratio at each turn's bandwidth with its launch's compiled floor off
            return r[f"compiled_ratio_{f}"] * (r[f"compiled_{f}"] - r[f"floor_of_{f}"]) / r[f"compiled_{f}"]
        rows = [f"| {f} | {r[f'decode_{f}']:.1f} | {r[f'compiled_{f}']:.1f} | "
                f"{r[f'compiled_{f}'] / r[f'decode_{f}']:.2f}x | "
                f"{r[f'compiled_{f}'] / (r[f'bytes_{f}'] / bws[f] * 1e3):.2f}x | {r[f'compiled_ratio_{f}']:.2f}x | "
                + ("" if floored is None else f"{less_floor(f):.2f}x | ")
                + f"{r[f'compile_{f}']:.0f} |" for f in FORMATS]
        table += "\n\n" + "\n".join(["| format | eager ms/token | compiled ms/token | compiled / eager | "
                                      "compiled / limit | compiled / limit, each turn's bandwidth | "
                                      + ("" if floored is None else "the same less the compiled floor | ")
                                      + "compile s |", "|---|---|---|---|---|---|---|"
                                      + ("" if floored is None else "---|")] + rows)
        if floored is not None:
            table += ("\n\nCompiled as transformers compiles a decode (a static cache, the forward compiled by "
                      "`generate`: `static_compiled`); the float32 floor compiled so, in each format's launch: "
                      + ", ".join(f"{r[f'floor_of_{f}']:.2f}" for f in FORMATS) + " ms/token.")
    print(f"{table}\n\nLlama hidden {shape['hidden']}, MLP {shape['mlp']}, {shape['layers']} layers, "
          f"{' / '.join(map(str, heads_of(shape)))} heads, vocabulary {VOCAB} (seed {seed}); TP{args.world}, "
          f"{args.world} gloo process{'es' if args.world > 1 else ''}, "
          f"{args.threads} thread{'s' if args.threads > 1 else ''} each; {args.tokens} tokens, median of {args.repeats} alternating rounds; "
          f"streaming bandwidth per rank with all {args.world} reading {bw / 1e9:.1f}"
          f"{f'-{max(bws.values()) / 1e9:.1f}' if max(bws.values()) > bw else ''} GB/s; load average {load:.2f}; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {datetime.date.today().isoformat()}.")


if __name__ == "__main__":
    main()
