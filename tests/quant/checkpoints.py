"""Quantized checkpoints made the way the ecosystem makes them, and their single-process references.

compressed-tensors checkpoints are written by compressed-tensors itself (its scheme applied to the model, min-max
scales, its compressor packing, `save_pretrained`); the reference is transformers' own loader of the directory
(`CompressedTensorsConfig(dequantize=True)`). Hugging Face FP8 checkpoints are written as DeepSeek-V3's are
(FP8 values, one `weight_scale_inv` per 128 x 128 block); the reference is transformers' loader with
`FineGrainedFP8Config(dequantize=True)`. GPTQ and AWQ have no CPU loader on this torch (gptqmodel needs torch >=
2.14.1, autoawq is retired): their checkpoints are made by repacking the integers and scales of a
compressed-tensors checkpoint into the GPTQ / AWQ layouts (`to_gptq`, `to_awq`, following each format's
definition), so the compressed-tensors directory's transformers load is their reference: same integers, same
scales, the same dense weight.
"""
from __future__ import annotations

import copy
import json
import math
import os
import shutil
import threading

import torch
from safetensors.torch import load_file, save_file

_LOCK = threading.Lock()
VOCAB = 101


def llama():
    """hidden 256 (8 heads of 32, 2 KV heads), intermediate 640 = 5 groups of 128: a row-parallel layer whose
    groups do not divide by 2 or 3."""
    import transformers as tr

    cfg = tr.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=640, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64)
    with _LOCK:
        torch.manual_seed(7)
        return tr.LlamaForCausalLM(cfg).eval()


def qwen2():
    """Tied embeddings and q/k/v biases; intermediate 320 = 5 groups of 64."""
    import transformers as tr

    cfg = tr.Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=320, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    with _LOCK:
        torch.manual_seed(8)
        return tr.Qwen2ForCausalLM(cfg).eval()


def phi3():
    """Fused `qkv_proj` (q 256, k 64, v 64 rows) and `gate_up_proj` (2 x 640): split piece by piece, each piece's
    scales and packed zero points with it."""
    import transformers as tr

    cfg = tr.Phi3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=640, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2)
    with _LOCK:
        torch.manual_seed(9)
        return tr.Phi3ForCausalLM(cfg).eval()


def _minmax(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    if args.strategy == "group":
        g = w.unflatten(-1, (-1, args.group_size))
        return g.amin(-1), g.amax(-1)
    if args.strategy == "channel":
        return w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    bh, bw = args.block_structure
    o, i = w.shape
    pad = torch.nn.functional.pad(w, (0, math.ceil(i / bw) * bw - i, 0, math.ceil(o / bh) * bh - o))
    b = pad.reshape(pad.shape[0] // bh, bh, pad.shape[1] // bw, bw).transpose(1, 2)
    return b.amin((-1, -2)), b.amax((-1, -2))


def _compress(m, fmt: str | None, ignore: list[str], weights: dict):
    """compressed-tensors' scheme with `weights` (QuantizationArgs fields) applied to `m`'s linear layers but
    `ignore`, each group's scale and zero point from its min and max, the weights compressed in place in `fmt`
    (None: the format compressed-tensors picks): the compressor, which writes the config's quantization_config."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(**weights)
    qc = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                            ignore=ignore, **({} if fmt is None else {"format": fmt}))
    apply_quantization_config(m, qc)
    for mod in m.modules():
        if hasattr(mod, "weight_scale"):
            s, z = calculate_qparams(*_minmax(mod.weight.data, args), args)
            mod.weight_scale.data.copy_(s)
            if hasattr(mod, "weight_zero_point"):
                mod.weight_zero_point.data.copy_(z)
    compressor = ModelCompressor.from_pretrained_model(m, quantization_format=fmt)
    compressor.compress_model(m)
    return compressor


def compressed_tensors(model, directory: str, fmt: str | None, **weights) -> str:
    """`model` quantized by compressed-tensors with `weights` (QuantizationArgs fields), saved in `fmt` (None: the
    format compressed-tensors picks itself)."""
    m = copy.deepcopy(model)
    compressor = _compress(m, fmt, ["lm_head"], weights)
    m.save_pretrained(directory)
    compressor.update_config(directory)
    return directory


def hf_fp8(model, directory: str, block=(128, 128)) -> str:
    """DeepSeek-V3's FP8 format: `weight` in float8_e4m3fn, `weight_scale_inv` per block (amax / 448)."""
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    bh, bw = block
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            w = mod.weight.detach()
            o, i = w.shape
            rows, cols = math.ceil(o / bh), math.ceil(i / bw)
            amax = torch.stack([torch.stack([w[r * bh:(r + 1) * bh, c * bw:(c + 1) * bw].abs().amax()
                                             for c in range(cols)]) for r in range(rows)])
            scale = (amax / 448.0).clamp(min=1e-12)
            full = scale.repeat_interleave(bh, 0)[:o].repeat_interleave(bw, 1)[:, :i]
            sd[f"{name}.weight"] = (w / full).to(torch.float8_e4m3fn)
            sd[f"{name}.weight_scale_inv"] = scale.float()
    if getattr(model.config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    os.makedirs(directory, exist_ok=True)
    save_file(sd, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block), "modules_to_not_convert": ["lm_head"]}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return directory


# ------------------------------------------------------------------------------------ GPTQ / AWQ by repacking
def _ct_layers(directory: str):
    """compressed-tensors' int4 layers of a pack-quantized directory: name -> (q, z, scale) as unsigned ints
    (values + 8) `[out, in]`, `[out, groups]` and the scales `[out, groups]`, unpacked by compressed-tensors."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    sd = load_file(os.path.join(directory, "model.safetensors"))
    out = {}
    for k in [k for k in sd if k.endswith(".weight_packed")]:
        name = k[:-len(".weight_packed")]
        shape = torch.Size(sd[f"{name}.weight_shape"].tolist())
        scale = sd[f"{name}.weight_scale"]
        q = unpack_from_int32(sd[k], 4, shape).to(torch.int32) + 8
        zp = sd.get(f"{name}.weight_zero_point")
        z = (unpack_from_int32(zp, 4, torch.Size([shape[0], scale.shape[1]]), packed_dim=0).to(torch.int32) + 8
             if zp is not None else torch.full(scale.shape, 8, dtype=torch.int32))
        out[name] = (q, z, scale)
    return sd, out


def pack(values: torch.Tensor, dim: int, order=None) -> torch.Tensor:
    """Unsigned 4-bit `values` packed eight to an int32 word along `dim`, value j of a run in bits [4j, 4j+4)
    (`order`: the run's value positions in the word, AWQ's interleave)."""
    v = values.movedim(dim, -1).to(torch.int64)
    v = v.unflatten(-1, (-1, 8))
    if order is not None:
        v = v[..., list(order)]
    word = sum(v[..., j] << (4 * j) for j in range(8))
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)
    return word.movedim(-1, dim).contiguous()


def _repacked(ct_dir: str, directory: str, quant_config: dict, layer) -> str:
    sd, layers = _ct_layers(ct_dir)
    for name, (q, z, scale) in layers.items():
        for suffix in ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point"):
            sd.pop(f"{name}.{suffix}", None)
        sd.update({f"{name}.{k}": v for k, v in layer(q, z, scale).items()})
    os.makedirs(directory, exist_ok=True)
    save_file(sd, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(ct_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quant_config
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return directory


def to_gptq(ct_dir: str, directory: str, group: int = 128, desc_act: bool = False) -> str:
    """GPTQ v1: `qweight [in/8, out]` packed along the input, `qzeros [groups, out/8]` holding zero - 1,
    `scales [groups, out]`, `g_idx [in]`. With `desc_act` the groups are relabelled by a fixed permutation (g_idx
    no longer sorted, scales stored in the permuted order): the same dense weight through act-order's path."""
    def layer(q, z, scale):
        groups = scale.shape[1]
        perm = torch.randperm(groups, generator=torch.Generator().manual_seed(groups)) if desc_act \
            else torch.arange(groups)
        g_idx = perm[torch.arange(q.shape[1]) // group].to(torch.int32)
        zs, ss = torch.empty_like(z), torch.empty_like(scale)
        zs[:, perm], ss[:, perm] = z, scale
        return {"qweight": pack(q.t(), 0), "qzeros": pack((zs - 1).t(), 1), "scales": ss.t().contiguous(),
                "g_idx": g_idx}

    return _repacked(ct_dir, directory, {"quant_method": "gptq", "bits": 4, "group_size": group,
                                         "desc_act": desc_act, "sym": False, "checkpoint_format": "gptq"}, layer)


AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def to_awq(ct_dir: str, directory: str, group: int = 128) -> str:
    """AWQ GEMM: `qweight [in, out/8]` packed along the output in AWQ's interleaved order, `qzeros [groups,
    out/8]` likewise, `scales [groups, out]`."""
    def layer(q, z, scale):
        return {"qweight": pack(q.t(), 1, AWQ_PACK_ORDER), "qzeros": pack(z.t(), 1, AWQ_PACK_ORDER),
                "scales": scale.t().contiguous()}

    return _repacked(ct_dir, directory, {"quant_method": "awq", "bits": 4, "group_size": group,
                                         "zero_point": True, "version": "gemm"}, layer)


def reference(directory: str, ct_dir: str | None = None, dtype=None):
    """transformers' single-process load of the directory, dequantized (of `ct_dir` for GPTQ / AWQ), at `dtype`
    (None: transformers' default, the config's)."""
    import transformers as tr

    path = ct_dir or directory
    with open(os.path.join(path, "config.json")) as f:
        method = json.load(f)["quantization_config"]["quant_method"]
    qc = tr.FineGrainedFP8Config(dequantize=True) if method == "fp8" else tr.CompressedTensorsConfig(dequantize=True)
    kw = {} if dtype is None else {"dtype": dtype}
    return tr.AutoModelForCausalLM.from_pretrained(path, quantization_config=qc, **kw).eval()


def copy_with_config(src: str, dst: str, change) -> str:
    """A copy of checkpoint `src` whose quantization_config `change(qc)` edits (bad-input tests)."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        config = json.load(f)
    change(config["quantization_config"])
    with open(path, "w") as f:
        json.dump(config, f)
    return dst


# ------------------------------------------------------------------------------------ the formats the tests make
IDS = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
INT4 = dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=128)
FORMATS = {  # name -> (model, maker(directory, base, made) -> (directory, reference directory or None))
    "ct-int4-group-asym": ("llama", lambda d, m, made: (compressed_tensors(m, d, "pack-quantized", **INT4), None)),
    "ct-int4-group-sym": ("qwen2", lambda d, m, made: (compressed_tensors(
        m, d, "pack-quantized", num_bits=4, type="int", symmetric=True, strategy="group", group_size=64), None)),
    "ct-int4-phi3-fused": ("phi3", lambda d, m, made: (compressed_tensors(m, d, "pack-quantized", **INT4), None)),
    "ct-int8-channel-pack": ("llama", lambda d, m, made: (compressed_tensors(
        m, d, "pack-quantized", num_bits=8, type="int", symmetric=True, strategy="channel"), None)),
    "ct-w8a16-int": ("qwen2", lambda d, m, made: (compressed_tensors(
        m, d, "int-quantized", num_bits=8, type="int", symmetric=True, strategy="channel"), None)),
    "ct-fp8-channel": ("llama", lambda d, m, made: (compressed_tensors(
        m, d, "float-quantized", num_bits=8, type="float", strategy="channel"), None)),
    # weight-only FP8 as compressed-tensors writes it when given no format: `naive-quantized`, FP8 `weight`
    "ct-fp8-naive": ("llama", lambda d, m, made: (compressed_tensors(
        m, d, None, num_bits=8, type="float", strategy="channel"), None)),
    "ct-fp8-block": ("llama", lambda d, m, made: (compressed_tensors(
        m, d, "float-quantized", num_bits=8, type="float", strategy="block", block_structure=[128, 128]), None)),
    "hf-fp8-block": ("llama", lambda d, m, made: (hf_fp8(m, d), None)),
    "gptq": ("llama", lambda d, m, made: (to_gptq(made("ct-int4-group-asym"), d), made("ct-int4-group-asym"))),
    "gptq-desc-act": ("llama", lambda d, m, made: (to_gptq(made("ct-int4-group-asym"), d, desc_act=True),
                                                   made("ct-int4-group-asym"))),
    "awq": ("llama", lambda d, m, made: (to_awq(made("ct-int4-group-asym"), d), made("ct-int4-group-asym"))),
}


# ------------------------------------------------------------------------------------ MoE: per-expert checkpoints
def mixtral():
    """4 experts of intermediate 256 (2 groups of 128), 2 per token; hidden 128."""
    import transformers as tr

    cfg = tr.MixtralConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=64)
    with _LOCK:
        torch.manual_seed(10)
        return tr.MixtralForCausalLM(cfg).eval()


def qwen3_moe():
    """6 experts of moe intermediate 128, 2 per token, q/k norms; hidden 128."""
    import transformers as tr

    cfg = tr.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=6,
                            num_experts_per_tok=2, max_position_embeddings=64, head_dim=32)
    with _LOCK:
        torch.manual_seed(11)
        return tr.Qwen3MoeForCausalLM(cfg).eval()


def _shadow(state: dict, keep) -> torch.nn.Module:
    """A module tree holding an `nn.Linear` at the path of every 2-D `.weight` of `state` that `keep(path)` accepts,
    with that weight: the checkpoint's layout, one Linear per expert projection (as llm-compressor sees a model)."""
    root = torch.nn.Module()
    for key, t in state.items():
        path = key[:-len(".weight")] if key.endswith(".weight") else None
        if path is None or t.dim() != 2 or not keep(path):
            continue
        parent = root
        for part in path.split(".")[:-1]:
            if part not in parent._modules:
                parent.add_module(part, torch.nn.Module())
            parent = parent._modules[part]
        lin = torch.nn.Linear(t.shape[1], t.shape[0], bias=False, dtype=t.dtype)
        lin.weight.data.copy_(t)
        parent.add_module(path.split(".")[-1], lin)
    return root


def compressed_moe(model, directory: str, fmt: str, **weights) -> str:
    """`model` (a transformers MoE) saved in its checkpoint layout (one tensor per expert projection, as
    `save_pretrained` writes it), every linear layer but the routers and the LM head quantized by compressed-tensors
    with `weights`, in `fmt` (what llm-compressor's MoE recipes give)."""
    model.save_pretrained(directory)
    path = os.path.join(directory, "model.safetensors")
    state = load_file(path)
    shadow = _shadow(state, lambda p: not p.endswith(("lm_head", "embed_tokens", ".gate")))
    compressor = _compress(shadow, fmt, ["lm_head", "re:.*gate$"], weights)
    quantized = {k: v.detach().clone().contiguous() for k, v in shadow.state_dict().items()}
    state = {k: v for k, v in state.items() if not (k.endswith(".weight") and k[:-len(".weight")] in
                                                    {n for n, _ in shadow.named_modules()})}
    save_file({**state, **quantized}, path, metadata={"format": "pt"})
    compressor.update_config(directory)
    return directory


def _fp8_blocks(w: torch.Tensor, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's FP8 of one weight: FP8 values and one float32 `weight_scale_inv` per block (amax / 448)."""
    bh, bw = block
    o, i = w.shape
    rows, cols = math.ceil(o / bh), math.ceil(i / bw)
    amax = torch.stack([torch.stack([w[r * bh:(r + 1) * bh, c * bw:(c + 1) * bw].abs().amax() for c in range(cols)])
                        for r in range(rows)])
    scale = (amax.float() / 448.0).clamp(min=1e-12)
    full = scale.repeat_interleave(bh, 0)[:o].repeat_interleave(bw, 1)[:, :i]
    return (w.float() / full).to(torch.float8_e4m3fn), scale


def hf_fp8_moe(model, directory: str, block=(128, 128)) -> str:
    """A MoE model in DeepSeek-V3's / Qwen3-30B-A3B-FP8's format, in its checkpoint layout (one tensor per expert
    projection): every linear weight but the routers' and the LM head's as FP8 blocks."""
    model.save_pretrained(directory)
    path = os.path.join(directory, "model.safetensors")
    state = load_file(path)
    for key in [k for k, t in state.items() if k.endswith(".weight") and t.dim() == 2
                and not k[:-len(".weight")].endswith(("lm_head", "embed_tokens", ".gate"))]:
        state[key], state[key + "_scale_inv"] = _fp8_blocks(state[key], block)
    save_file(state, path, metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block), "modules_to_not_convert": ["lm_head", "gate"]}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return directory


#: llm-compressor's W4A16 (symmetric: transformers' loader of quantized experts reads no zero points)
INT4_SYM = dict(INT4, symmetric=True)
MOE_FORMATS = {  # name -> (model, maker(directory, base))
    "mixtral-int4": ("mixtral", lambda d, m: compressed_moe(m, d, "pack-quantized", **INT4_SYM)),
    "mixtral-int8": ("mixtral", lambda d, m: compressed_moe(m, d, "pack-quantized", num_bits=8, type="int",
                                                            symmetric=True, strategy="channel")),
    "mixtral-fp8-block": ("mixtral", lambda d, m: hf_fp8_moe(m, d)),
    "qwen3-moe-int4": ("qwen3_moe", lambda d, m: compressed_moe(m, d, "pack-quantized", **INT4_SYM)),
    "qwen3-moe-fp8-block": ("qwen3_moe", lambda d, m: hf_fp8_moe(m, d)),
}
