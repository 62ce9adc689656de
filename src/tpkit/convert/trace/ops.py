"""The torch ops the dataflow trace (`dataflow.py`) tells apart, by name: how each one treats the features of the
tensors it takes."""
from __future__ import annotations

# Ops that act on every element alone (or with a scalar / per-row operand): shards pass straight through.
ELEMENTWISE = frozenset("""
add sub mul div true_divide neg abs exp log sqrt rsqrt pow square sigmoid tanh relu relu_ relu6 gelu silu
mish hardswish hardsigmoid hardtanh leaky_relu elu selu celu softplus softsign logsigmoid tanhshrink
dropout dropout_ alpha_dropout feature_alpha_dropout erf erfc clamp clamp_ clip where
to float half bfloat16 double type type_as contiguous clone detach masked_fill masked_fill_
__add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__ __truediv__ __rtruediv__
__itruediv__ __neg__ __pow__ add_ mul_ sub_ div_ sigmoid_ tanh_ silu_ gelu_ cos sin
""".split())
# Ops that only read metadata: they neither carry nor break a tag.
METADATA = frozenset("size dim shape numel __get__ __len__ is_floating_point get_device is_contiguous".split())
SPLITS = frozenset(("split", "chunk", "tensor_split", "unbind"))
# Ops that move or add leading axes: they keep every feature in place when the last axis keeps its size.
LAYOUT = frozenset("unsqueeze squeeze expand expand_as transpose permute movedim repeat".split())
RESHAPES = frozenset(("view", "reshape", "flatten", "unflatten", "view_as", "reshape_as"))
# Ops whose tensor arguments after the first give only a shape or a dtype, none of their values.
SHAPE_OF = frozenset(("view_as", "reshape_as", "expand_as", "type_as"))
# Ops that cut, join or reorder a tensor along an axis: on a headed tensor, along any axis but the last, they may
# take heads apart or put them together (a differential attention's head halves).
CUTS = SPLITS | frozenset("cat concat concatenate narrow __getitem__ index_select repeat repeat_interleave roll "
                          "flip gather take_along_dim".split())
JOINS = frozenset(("cat", "concat", "concatenate"))
