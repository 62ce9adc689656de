"""`tpkit demo`: tensor parallelism end to end on a small Llama-style model, on 2 local gloo ranks.

1. the analysis table (which layers split, how, and why the rest stay replicated), its world size suggested by the
   setup search where this machine is priced already (a speed profile, a GPU of a known kind), else by memory: the
   demo never runs a calibration (a quick one took 107 s of the first demo's 118 s on the 2-core development box,
   BENCHMARKS.md), it says how to run one;
2. the conversion on each rank (the `parallelize` call alone is timed), and its logits against the original
   model's;
3. a few AdamW training steps on each rank, whose losses match one device's step for step;
4. per-rank memory (parameters, gradients, optimizer state) and step times.
"""
from __future__ import annotations

import argparse
import sys
import time

from tpkit.tables import WIDE_HELP

HF_EXTRA_HINT = "install the hf extra: pip install 'tpkit[hf]'"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=2, help="number of local ranks (default 2)")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "threads"])
    parser.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    parser.add_argument("--wide", action="store_true", help=WIDE_HELP)


def _config():
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
                         tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return config


def _model(state=None):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config())
    if state is not None:
        model.load_state_dict(state)
    return model


def _batch():
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 1000, (4, 32), generator=g)


def _train(model, steps: int):
    """(losses, median step seconds) of `steps` AdamW steps on one fixed batch."""
    import torch

    ids = _batch()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, times = [], []
    for _ in range(steps):
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    state_bytes = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                      if hasattr(t, "numel") and t.dim() > 0)
    return losses, sorted(times)[len(times) // 2], state_bytes


def _rank_body(state, ref_logits, steps):
    import torch

    import tpkit
    from tpkit.convert import parallelize

    comm = tpkit.get_communicator()
    torch.set_num_threads(1)
    model = _model(state).eval()  # built before the clock starts: only the conversion is timed
    start = time.perf_counter()
    model = parallelize(model, comm=comm)
    convert_s = time.perf_counter() - start
    with torch.no_grad():
        logits = model(input_ids=_batch()).logits
    err = ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
    trainee = parallelize(_model(state), comm=comm, mode="training")
    losses, step_s, opt_bytes = _train(trainee, steps)
    params = sum(p.numel() * p.element_size() for p in trainee.parameters())
    styles = trainee.tp_plan.entries
    return {"rank": comm.rank, "err": err, "losses": losses, "step_s": step_s, "convert_s": convert_s,
            "param_bytes": params, "opt_bytes": opt_bytes, "split": sum(s != "replicate" for s in styles.values()),
            "layers": len(styles), "local_logits": trainee.lm_head.weight.shape[0]}


def _unpriced_note() -> str | None:
    """What the demo says when nothing prices this machine (so its suggestion was by memory): no calibration ran,
    and how to run one; None when a profile or a known GPU prices it."""
    from tpkit.estimate.pricing import NotPriced, machine_pricing
    from tpkit.estimate.profile import default_profile_path

    try:
        machine_pricing(calibrate=False)
    except NotPriced:
        return (f"no calibration ran: no speed profile at {default_profile_path()}, so the world size above is "
                f"suggested by memory alone. `tpkit estimate --calibrate` measures this machine once (minutes on a "
                f"small CPU host; --quick: fewer repeats) and writes that file; `tpkit analyze`, `estimate` and "
                f"`search` then rank world sizes by predicted time (with no file they run a quick calibration first)")
    return None


def run(args: argparse.Namespace) -> int:
    try:  # the demo model is a Hugging Face Llama; transformers is an optional extra
        import transformers  # noqa: F401
    except ImportError as exc:
        print(f"tpkit demo: the demo needs transformers ({exc}); {HF_EXTRA_HINT}", file=sys.stderr)
        return 2
    import torch
    from rich.console import Console

    import tpkit
    from tpkit.setups import analyze
    from tpkit.tables import format_bytes as human
    from tpkit.tables import Column, output_width, render_table, wrap_text

    width = output_width(wide=args.wide)  # a terminal's (or 100 piped): tables leave out columns to fit; --wide: none
    console = Console(width=width, soft_wrap=width is None)

    def show(text: str) -> None:  # text already fitted to `width`
        console.print(text, markup=False, highlight=False, soft_wrap=True)

    began = time.perf_counter()
    torch.set_num_threads(1)
    w = args.world_size
    console.print(f"[bold]tpkit {tpkit.__version__}: tensor-parallel demo[/bold] - a small Llama (4 layers, hidden "
                  f"128, 8 query / 4 KV heads, vocab 1000) on {w} {args.backend} ranks\n")
    model = _model()
    # the budget: a GPU's, else this host's, said so; never a calibration here (see the module doc)
    report = analyze(model, world_size=w, max_world_size=4, calibrate=False)
    show(report.summary(width=width).rstrip("\n"))
    unpriced = _unpriced_note()
    if unpriced:
        show(wrap_text(unpriced, width))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        ref_logits = model.eval()(input_ids=_batch()).logits
    ref_losses, ref_step, ref_opt = _train(_model(state), args.steps)
    ref_params = sum(p.numel() * p.element_size() for p in model.parameters())
    console.print(f"\n[bold]converting[/bold] on {w} ranks (tpkit.launch, backend={args.backend}) ...")
    results = tpkit.launch(_rank_body, w, backend=args.backend, args=(state, ref_logits, args.steps), timeout=120)
    r0 = results[0]
    convert_ms = max(r["convert_s"] for r in results) * 1e3
    console.print(f"each rank swapped {r0['split']} of {r0['layers']} layers for tpkit.nn shards: converted in "
                  f"{convert_ms:.0f} ms (the parallelize() call alone, slowest of {w} ranks; model construction and "
                  f"rank start-up not included); training-mode LM head keeps {r0['local_logits']} of 1000 logits per "
                  f"rank (vocab_parallel_cross_entropy)")
    errs = ", ".join(f"rank {r['rank']}: {r['err']:.1e}" for r in results)
    console.print(f"logits vs the original model, max relative error: {errs}")
    # at a narrow width the last ranks' loss columns go first: "max |diff|" still covers every rank
    columns = [Column("step"), Column("1 device"), *(Column(f"rank {r['rank']}", drop=r["rank"]) for r in results),
               Column("max |diff|")]
    rows, worst = [], 0.0
    for i, ref in enumerate(ref_losses):
        diff = max(abs(r["losses"][i] - ref) for r in results)
        worst = max(worst, diff)
        rows.append([str(i + 1), f"{ref:.6f}", *[f"{r['losses'][i]:.6f}" for r in results], f"{diff:.1e}"])
    show(render_table(f"AdamW training: loss per step, one device vs {w} ranks", columns, rows, width))
    rows = [["1 device", human(ref_params), human(ref_params), human(ref_opt), f"{ref_step * 1e3:.1f} ms"]]
    rows += [[f"rank {r['rank']}", human(r["param_bytes"]), human(r["param_bytes"]), human(r["opt_bytes"]),
              f"{r['step_s'] * 1e3:.1f} ms"] for r in results]
    columns = [Column(""), Column("parameters"), Column("gradients", drop=1), Column("AdamW state"),
               Column("step time")]
    show(render_table("memory and time per rank (CPU, fp32)", columns, rows, width))
    ok = worst < 1e-4 * max(abs(x) for x in ref_losses) and all(r["err"] < 1e-4 for r in results)
    console.print(f"[bold]{'PASS' if ok else 'FAIL'}[/bold]: outputs and losses equal one device's "
                  f"(max loss difference {worst:.1e}); step times on a shared 2-core CPU show the mechanics, not a "
                  f"speed-up; demo took {time.perf_counter() - began:.1f} s")
    return 0 if ok else 1
