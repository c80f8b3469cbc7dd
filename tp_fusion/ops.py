"""Op definitions: the aten implementation of every op, and shape/dtype inference from it.

Inference runs the aten implementation on meta tensors, so shapes, broadcasting and type
promotion follow torch exactly. Symbolic extents (-1) are stood in for by a large prime during
inference and mapped back afterwards. At run time the same implementation runs on local shards;
ops whose attributes hold global extents get them rewritten to local ones by ``localize``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tp_fusion.errors import DefinitionError
from tp_fusion.types import DataType

SYMBOLIC = 1_000_003  # stands in for a symbolic extent during inference


@dataclass(frozen=True)
class OpDef:
    impl: Callable  # impl(*inputs, **attrs) -> tensor or tuple of tensors
    num_outputs: int = 1


def _binary(fn):
    def impl(a, b):
        if not isinstance(a, torch.Tensor):
            a = torch.as_tensor(a, device=b.device)
        if not isinstance(b, torch.Tensor):
            b = torch.as_tensor(b, device=a.device)
        return fn(a, b)
    return impl


def _gelu(x, approximate="none"):
    return F.gelu(x, approximate=approximate)


def _cast(x, dtype):
    return x.to(dtype.torch)


def _sum(x, dims, keepdim=False, dtype=None):
    return torch.sum(x, dim=dims, keepdim=keepdim, dtype=dtype.torch if dtype else None)


def _mean(x, dims, keepdim=False, dtype=None, count=None):
    """``count`` is the GLOBAL number of reduced elements, so a mean over a sharded dim can be
    computed as a partial sum of local sums divided by the global count."""
    local = math.prod(x.shape[d] for d in dims)
    if count is None or count == local:
        return torch.mean(x, dim=dims, keepdim=keepdim, dtype=dtype.torch if dtype else None)
    return torch.sum(x, dim=dims, keepdim=keepdim, dtype=dtype.torch if dtype else None) / count


def _amax(x, dims, keepdim=False):
    return torch.amax(x, dim=dims, keepdim=keepdim)


def _var_mean(x, dims, correction=1, keepdim=False):
    return torch.var_mean(x, dim=dims, correction=correction, keepdim=keepdim)


def _linear(x, w, b=None):
    return F.linear(x, w, b)


def _reshape(x, shape):
    return x.reshape(shape)


def _permute(x, dims):
    return x.permute(dims)


def _broadcast_in_dim(x, shape, broadcast_dims):
    view = [1] * len(shape)
    for i, d in enumerate(broadcast_dims):
        view[d] = x.shape[i]
    target = [view[d] if e == -1 else e for d, e in enumerate(shape)]
    return x.reshape(view).expand(target)


def _squeeze(x, dims):
    return x.squeeze(dims) if dims else x


def _set(x):
    return x.clone()


def _layer_norm(x, weight=None, bias=None, normalized_shape=(), eps=1e-5):
    return F.layer_norm(x, normalized_shape, weight, bias, eps)


def _full(shape, fill_value, dtype, device="cpu"):
    return torch.full(shape, fill_value, dtype=dtype.torch, device=device)


OPS: dict[str, OpDef] = {
    **{name: OpDef(getattr(torch, name)) for name in
       ("neg", "abs", "exp", "log", "tanh", "sigmoid", "relu", "sqrt", "rsqrt")},
    "silu": OpDef(F.silu),
    "gelu": OpDef(_gelu),
    "cast": OpDef(_cast),
    **{name: OpDef(_binary(getattr(torch, name))) for name in
       ("add", "sub", "mul", "div", "pow", "maximum", "minimum")},
    "where": OpDef(lambda c, a, b: torch.where(c, a, b)),
    "sum": OpDef(_sum),
    "mean": OpDef(_mean),
    "amax": OpDef(_amax),
    "var_mean": OpDef(_var_mean, num_outputs=2),
    "linear": OpDef(_linear),
    "matmul": OpDef(torch.matmul),
    "reshape": OpDef(_reshape),
    "permute": OpDef(_permute),
    "broadcast_in_dim": OpDef(_broadcast_in_dim),
    "squeeze": OpDef(_squeeze),
    "unsqueeze": OpDef(lambda x, dim: x.unsqueeze(dim)),
    "set": OpDef(_set),
    "layer_norm": OpDef(_layer_norm),
    "softmax": OpDef(lambda x, dim: torch.softmax(x, dim)),
    "full": OpDef(_full),
}

UNARY_OPS = ("neg", "abs", "exp", "log", "tanh", "sigmoid", "relu", "silu", "sqrt", "rsqrt")
BINARY_OPS = ("add", "sub", "mul", "div", "pow", "maximum", "minimum")
REDUCTION_OPS = ("sum", "mean", "amax", "var_mean")


def run(kind: str, args: list, attrs: dict):
    return OPS[kind].impl(*args, **attrs)


def _meta(shape: tuple[int, ...], dtype: DataType) -> torch.Tensor:
    return torch.empty([SYMBOLIC if e < 0 else e for e in shape], dtype=dtype.torch, device="meta")


def _unmeta(shape) -> tuple[int, ...]:
    return tuple(-1 if e > 0 and e % SYMBOLIC == 0 else int(e) for e in shape)


def infer(kind: str, args: list, attrs: dict, describe: Callable[[], str]):
    """Shapes and dtypes of ``kind``'s outputs for args given as (shape, DataType) pairs or
    scalars. Raises DefinitionError naming the op and its operands when torch rejects them."""
    meta_args = [_meta(*a) if isinstance(a, tuple) else a for a in args]
    meta_attrs = {k: (tuple(SYMBOLIC if e < 0 else e for e in v) if k == "shape" and kind == "full" else v)
                  for k, v in attrs.items()}
    try:
        out = run(kind, meta_args, meta_attrs)
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        raise DefinitionError(f"{kind}: cannot apply to {describe()}: {e}") from None
    outs = out if isinstance(out, tuple) else (out,)
    return [(_unmeta(o.shape), DataType.from_torch(o.dtype)) for o in outs]


def localize(kind: str, attrs: dict, in_global: list, out_global: tuple[int, ...],
             out_local: tuple[int, ...], device) -> dict:
    """Attributes for running ``kind`` on local shards: global extents become local ones."""
    if kind in ("reshape", "broadcast_in_dim"):
        return {**attrs, "shape": out_local}
    if kind == "full":
        return {**attrs, "shape": out_local, "device": device}
    if kind == "mean":
        return {**attrs, "count": math.prod(in_global[0][d] for d in attrs["dims"])}
    return attrs
