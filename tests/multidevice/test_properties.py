"""Property tests: random small fusions with random shardings equal torch on every rank; random
invalid schedules raise a TPFusionError on every rank, never hang, never return a wrong answer.

The tests run on the batched gloo ranks of the ``multidevice_test`` fixture. Hypothesis draws the
case seeds (plain data), derandomized and so alike on every rank; each rank rebuilds every case
from its seed with ``random.Random`` (identical on every rank), runs it, and the ranks compare
outcomes (result or error class) after each case. A failing case reports
its seed and its fusion, so it can be replayed with ``_run_case``.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from property_cases import ONCE, examples, seeds

from tp_fusion import DataType, DeviceMesh, FusionDefinition, ParallelType, TPFusionError, shard_tensor
from tp_fusion.runtime import dist

EXTENTS = (2, 4, 6, 8)
UNARY = ("relu", "tanh", "neg", "sigmoid", "abs", "sin", "erf", "atan")
BINARY = ("add", "sub", "mul", "maximum")
TORCH_REDUCTIONS = {"sum": torch.sum, "mean": torch.mean, "amax": torch.amax, "max": torch.amax, "min": torch.amin,
                    "prod": lambda t, dim, keepdim: t.prod(dim[0], keepdim=keepdim)}
SCANS = {"cumsum": torch.cumsum, "cummax": lambda t, dim: torch.cummax(t, dim).values}
TORCH_BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "maximum": torch.maximum}
# The wider menu (``_Case(wide=True)``, every drawn case): ops of tensor-parallel models and their reshardings.
WIDE = ("broadcast", "softmax", "norm", "cast", "slice", "cat", "where", "unsqueeze", "scalar", "activation", "lookup",
        "pad", "stretch", "divide")
ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu, "exp": torch.exp}
WIDE_EXTENTS = (*EXTENTS, 12, 16)
SCALAR_BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}
WIDE_2D = ("var", "triu", "select", "topk", "scan2", "native_norm")
# scans beyond SCANS (wide): cumsum with an init, cumprod (a chunked scan over a sharded dim too), cummin
WIDE_SCANS = {"cumsum": lambda t, dim: torch.cumsum(t, dim) + 0.5, "cumprod": torch.cumprod,
              "cummin": lambda t, dim: torch.cummin(t, dim).values}


class _Case:
    """One random fusion: its definition, full inputs, torch reference outputs."""

    def __init__(self, seed: int, mesh: DeviceMesh, world: int, invalid: bool, wide: bool = True):
        self.rng = rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.mesh, self.world, self.invalid = mesh, world, invalid
        self.wide = wide  # False: the narrow op menu the seeds in REGRESSIONS_* were found with
        self.tol = {"rtol": 1e-7, "atol": 1e-9}  # wider once a value was rounded to float32 (``cast``)
        self.extents = WIDE_EXTENTS if wide else EXTENTS
        self.fd = fd = FusionDefinition()
        self.inputs: list = []  # (tv, full)
        self.shapes: dict[int, tuple[int, ...]] = {}  # each tensor's concrete extents
        self.symbolic = wide and rng.random() < 0.2  # inputs defined with some extents symbolic (-1)
        self.meshes = [mesh]  # where ``_shard`` puts a tensor: the case's mesh, or some on other meshes of its devices
        if wide and rng.random() < 0.3:
            self.meshes += self._other_meshes()
        vals: list = []  # (tv, reference)
        for _ in range(rng.randint(1, 2)):
            vals.append(self._input(tuple(rng.choice(self.extents) for _ in range(rng.randint(2, 3)))))
        for _ in range(rng.randint(1, 7 if wide else 5)):
            vals.append(self._op(rng.choice(vals[-3:] if wide else vals[-2:])))
            self.shapes[vals[-1][0].name] = tuple(vals[-1][1].shape)
        outs = [vals[-1]]
        if len(vals) > 2 and rng.random() < 0.4:
            outs.append(rng.choice(vals[:-1]))
        for tv, _ in outs:
            fd.add_output(tv)
        self.outputs = [tv for tv, _ in outs]
        self.scheduled: set[int] = set()  # the tensors ``_shard`` put on the mesh
        self.refs = [ref for _, ref in outs]
        # The schedule, after the math: inputs, intermediates, outputs.
        outputs = {tv.name for tv, _ in outs}
        input_names = {tv.name for tv, _ in self.inputs}
        for i, (tv, _) in enumerate(vals):
            p = 0.7 if tv.name in input_names else 0.4 if tv.name in outputs else 0.25
            if i == 0 or rng.random() < p:  # the first input always: the fusion has a mesh
                self._shard(tv)
        if wide:  # the operands the ops drew (weights, biases, ...): a tensor-parallel model shards them too
            in_vals = {tv.name for tv, _ in vals}
            for tv, _ in self.inputs:
                if tv.name not in in_vals and rng.random() < 0.6:
                    self._shard(tv)
        self.error_kind = None
        if invalid:
            self.error_kind = rng.choice(("split", "shape", "dtype", "mesh", "count", *(("extent",) if wide else ())))
            if self.error_kind == "extent":
                self._bad_parallel(rng.choice(vals)[0])
            if self.error_kind == "split":
                self._bad_split(rng.choice(vals)[0])
            elif self.error_kind == "mesh":
                big = DeviceMesh(range(world + 1))
                tv = rng.choice(vals)[0]
                tv.set_device_mesh(big)
            self.bad_rank = rng.randrange(world)
            self.bad_input = None  # (wide) the input the bad rank passes wrongly: one it holds a part of
            if wide and self.error_kind in ("shape", "dtype"):
                held = [i for i, (tv, _) in enumerate(self.inputs) if tv.mesh is None or self.bad_rank in tv.mesh]
                if held:  # (an input it holds no part of it passes as an empty tensor, whatever its dtype)
                    self.bad_input = rng.choice(held)
                else:
                    self.error_kind = "count"

    # --- the math -----------------------------------------------------------------------------

    def _input(self, shape):
        declared = [-1 if self.symbolic and self.rng.random() < 0.5 else e for e in shape]
        order = None
        if self.wide and len(shape) > 1 and self.rng.random() < 0.15:  # laid out otherwise than row-major
            order = list(range(len(shape)))
            self.rng.shuffle(order)
        tv = self.fd.define_tensor(declared, dtype=DataType.Double, stride_order=order)
        full = torch.randn(shape, generator=self.gen, dtype=torch.float64)
        self.inputs.append((tv, full))
        self.shapes[tv.name] = tuple(shape)
        return tv, full

    def _indices(self, shape, high: int):
        tv = self.fd.define_tensor(list(shape), dtype=DataType.Int)
        full = torch.randint(0, high, shape, generator=self.gen, dtype=torch.int64)
        self.inputs.append((tv, full))
        self.shapes[tv.name] = tuple(shape)
        return tv, full

    def _op(self, val):
        rng, ops = self.rng, self.fd.ops
        tv, ref = val
        kinds = ["unary", "binary", "linear", "permute", "set"]
        if tv.ndim >= 2:
            kinds += ["reduction", "matmul", "reshape", "scan"]
        if self.wide:
            kinds += [*WIDE, *(WIDE_2D if tv.ndim >= 2 else ()), *(("attention",) if tv.ndim >= 3 else ()),
                      *(("grouped_mm",) if tv.ndim == 2 else ()),
                      *(("squeeze",) if 1 in ref.shape[1:] else ())]
        kind = rng.choice(kinds)
        if kind == "unary":
            name = rng.choice(UNARY)
            return getattr(ops, name)(tv), getattr(torch, name)(ref)
        if kind == "binary":
            name = rng.choice(BINARY)
            shape = tuple(ref.shape) if rng.random() < 0.7 else tuple(ref.shape[-1:])
            other, oref = self._input(shape)
            if rng.random() < 0.5:
                return getattr(ops, name)(tv, other), TORCH_BINARY[name](ref, oref)
            return getattr(ops, name)(other, tv), TORCH_BINARY[name](oref, ref)
        if kind == "reduction":
            name, dim, keep = rng.choice(sorted(TORCH_REDUCTIONS)), rng.randrange(tv.ndim), rng.random() < 0.3
            dims = [dim]
            if self.wide and tv.ndim == 3 and name != "prod" and rng.random() < 0.3:
                dims = sorted(rng.sample(range(3), 2))  # two dims at once
            out = getattr(ops, name)(tv, dims, keepdim=keep)
            return out, TORCH_REDUCTIONS[name](ref, dim=tuple(dims), keepdim=keep)
        if kind == "scan":
            name, dim = rng.choice(sorted(SCANS)), rng.randrange(tv.ndim)
            return getattr(ops, name)(tv, dim), SCANS[name](ref, dim)
        if kind == "linear":
            n = rng.choice(self.extents)
            w, wref = self._input((n, ref.shape[-1]))
            if rng.random() < 0.5:
                b, bref = self._input((n,))
                return ops.linear(tv, w, b), F.linear(ref, wref, bref)
            return ops.linear(tv, w), F.linear(ref, wref)
        if kind == "matmul":
            if self.wide and rng.random() < 0.5:  # batched: [B, M, K] @ [B, K, N] or [K, N], [M, K] @ [B, K, N]
                n = rng.choice(self.extents)
                if tv.ndim == 3:
                    shape = (ref.shape[0], ref.shape[-1], n) if rng.random() < 0.6 else (ref.shape[-1], n)
                else:
                    shape = (rng.choice(self.extents), ref.shape[-1], n)
                b, bref = self._input(shape)
                if rng.random() < 0.3 and tv.ndim == 3 and len(shape) == 3:  # the other way round: b^T @ tv^T
                    bt, tt = ops.permute(b, [0, 2, 1]), ops.permute(tv, [0, 2, 1])
                    return ops.matmul(bt, tt), torch.matmul(bref.permute(0, 2, 1), ref.permute(0, 2, 1))
                return ops.matmul(tv, b), torch.matmul(ref, bref)
            b, bref = self._input((ref.shape[-1], rng.choice(self.extents)))
            return ops.matmul(tv, b), torch.matmul(ref, bref)
        if kind == "reshape":
            s = tuple(ref.shape)
            if len(s) == 3 or (s[0] % 2 and s[1] % 2):
                shape = (s[0] * s[1], *s[2:])  # merge the leading two dims
            else:
                d = 0 if s[0] % 2 == 0 else 1
                shape = (*s[:d], 2, s[d] // 2, *s[d + 1:])  # split a dim
            if self.wide and rng.random() < 0.4:  # merge or split another pair of dims
                shape = self._other_reshape(s) or shape
            return ops.reshape(tv, list(shape)), ref.reshape(shape)
        if kind == "permute":
            dims = list(range(tv.ndim))
            rng.shuffle(dims)
            return ops.permute(tv, dims), ref.permute(dims)
        if kind == "set":
            return ops.set(tv), ref.clone()
        return self._wide_op(kind, tv, ref)

    def _other_reshape(self, s: tuple[int, ...]) -> tuple[int, ...] | None:
        """A merge of two adjacent dims, or a split of one dim by 2 or 4 (any dim, the last ones too)."""
        rng = self.rng
        if len(s) >= 2 and (len(s) == 3 or rng.random() < 0.5):
            d = rng.randrange(len(s) - 1)
            return (*s[:d], s[d] * s[d + 1], *s[d + 2:])
        splits = [(d, f) for d in range(len(s)) for f in (2, 4) if s[d] % f == 0 and s[d] > f]
        if not splits:
            return None
        d, f = rng.choice(splits)
        outer = rng.random() < 0.5
        return (*s[:d], *((f, s[d] // f) if outer else (s[d] // f, f)), *s[d + 1:])

    def _wide_op(self, kind: str, tv, ref):
        rng, ops = self.rng, self.fd.ops
        if kind == "broadcast":
            if tv.ndim < 3 and (tv.ndim == 1 or rng.random() < 0.4):  # a new dim
                pos, e = rng.randrange(tv.ndim + 1), rng.choice(self.extents)
                shape = [*ref.shape[:pos], e, *ref.shape[pos:]]
                bdims = [d for d in range(tv.ndim + 1) if d != pos]
                return ops.broadcast_in_dim(tv, shape, bdims), ref.unsqueeze(pos).expand(shape).contiguous()
            d = rng.randrange(tv.ndim)  # a 1-D operand along dim d (a bias, a scale) broadcast to tv's shape
            v, vref = self._input((ref.shape[d],))
            view = [1] * tv.ndim
            view[d] = ref.shape[d]
            name = rng.choice(BINARY)
            bv = ops.broadcast_in_dim(v, list(ref.shape), [d])
            return getattr(ops, name)(tv, bv), TORCH_BINARY[name](ref, vref.reshape(view).expand(ref.shape))
        if kind == "softmax":
            dim = rng.randrange(tv.ndim)
            return ops.softmax(tv, dim), torch.softmax(ref, dim)
        if kind == "norm":  # over the last dim: by hand (mean, var), var's, or layer_norm's
            how, last, eps = rng.choice(("chain", "var", "layer_norm")), tv.ndim - 1, 1e-5
            if how == "layer_norm":
                e = ref.shape[-1]
                params = [self._input((e,)) for _ in range(rng.choice((0, 1, 2)))]
                out = ops.layer_norm(tv, [e], *(p for p, _ in params), eps=eps)
                return out, F.layer_norm(ref, [e], *(r for _, r in params), eps=eps)
            mean = ops.mean(tv, [last], keepdim=True)
            centered = ops.sub(tv, mean)
            if how == "chain":
                var = ops.mean(ops.mul(centered, centered), [last], keepdim=True)
            else:
                var = ops.var(tv, [last], correction=0, keepdim=True)
            out = ops.mul(centered, ops.rsqrt(ops.add(var, eps)))
            c = ref - ref.mean(last, keepdim=True)
            return out, c * torch.rsqrt((c * c).mean(last, keepdim=True) + eps)
        if kind == "cast":  # Double -> Float -> Double: rounded to float32 once
            self.tol = {"rtol": 1e-5, "atol": 1e-6}
            return ops.cast(ops.cast(tv, DataType.Float), DataType.Double), ref.float().double()
        if kind == "slice":
            d = tv.ndim - 1 if rng.random() < 0.5 else rng.randrange(tv.ndim)
            e = ref.shape[d]
            if e % 2 == 0 and rng.random() < 0.5:  # whole halves (or the whole dim)
                start, end = rng.choice(((0, e // 2), (e // 2, e), (0, e)))
            else:
                start = rng.randrange(e)
                end = rng.randrange(start + 1, e + 1)
            starts, ends = [0] * tv.ndim, list(ref.shape)
            starts[d], ends[d] = start, end
            return ops.slice(tv, starts, ends), ref.narrow(d, start, end - start)
        if kind == "cat":
            d = rng.randrange(tv.ndim)
            if rng.random() < 0.3:
                other, oref = tv, ref
            else:
                shape = list(ref.shape)
                shape[d] = rng.choice(self.extents)
                other, oref = self._input(tuple(shape))
            if rng.random() < 0.5:
                return ops.cat([tv, other], d), torch.cat([ref, oref], d)
            return ops.cat([other, tv], d), torch.cat([oref, ref], d)
        if kind == "where":
            cond = ops.gt(tv, 0.0)
            if rng.random() < 0.5:
                return ops.where(cond, tv, 0.0), torch.where(ref > 0, ref, 0.0)
            other, oref = self._input(tuple(ref.shape))
            return ops.where(cond, other, tv), torch.where(ref > 0, oref, ref)
        if kind == "unsqueeze":
            if tv.ndim >= 3:
                return ops.set(tv), ref.clone()
            d = rng.randrange(tv.ndim + 1)
            return ops.unsqueeze(tv, d), ref.unsqueeze(d)
        if kind == "squeeze":
            dims = [d for d in range(1, tv.ndim) if ref.shape[d] == 1]
            return ops.squeeze(tv, dims), ref.squeeze(tuple(dims))
        if kind == "scalar":  # with a number: linear in a pending sum only where the number does not add
            name, c = rng.choice(sorted(SCALAR_BINARY)), rng.choice((2.0, -0.5, 1.0))
            if name == "div" or rng.random() < 0.5:
                return getattr(ops, name)(tv, c), SCALAR_BINARY[name](ref, c)
            return getattr(ops, name)(c, tv), SCALAR_BINARY[name](torch.tensor(c, dtype=ref.dtype), ref)
        if kind == "activation":
            name = rng.choice(sorted(ACTIVATIONS))
            if name == "gelu":
                approximate = rng.choice(("none", "tanh"))
                return ops.gelu(tv, approximate=approximate), F.gelu(ref, approximate=approximate)
            return getattr(ops, name)(tv), ACTIVATIONS[name](ref)
        if kind == "lookup":  # embedding (tv the table), index_select, take_along_axis
            how = rng.choice(("embedding", "index_select", "take_along_axis") if tv.ndim == 2 else
                             ("index_select", "take_along_axis"))
            if how == "embedding":
                idx, iref = self._indices((rng.choice(self.extents),) * rng.randint(1, 2), ref.shape[0])
                return ops.embedding_fwd(idx, tv), F.embedding(iref, ref)
            dim = rng.randrange(tv.ndim)
            if how == "index_select":
                idx, iref = self._indices((rng.choice(self.extents),), ref.shape[dim])
                return ops.index_select(tv, idx, dim), torch.index_select(ref, dim, iref)
            shape = list(ref.shape)
            shape[dim] = rng.choice(self.extents)
            idx, iref = self._indices(tuple(shape), ref.shape[dim])
            return ops.take_along_axis(tv, idx, dim), torch.take_along_dim(ref, iref, dim)
        if kind == "pad":
            widths = [rng.randint(0, 2) for _ in range(2 * rng.randint(1, min(tv.ndim, 2)))]
            value = rng.choice((0.0, 1.5))
            return ops.pad(tv, widths, value), F.pad(ref, widths, value=value)
        if kind == "triu":
            diagonal = rng.randint(-1, 1)
            return ops.triu(tv, diagonal), torch.triu(ref, diagonal)
        if kind == "select":
            dim = rng.randrange(tv.ndim)
            index = rng.randrange(ref.shape[dim])
            return ops.select(tv, index, dim), ref.select(dim, index)
        if kind == "topk":
            dim = rng.randrange(tv.ndim)
            k, largest = rng.randint(1, ref.shape[dim]), rng.random() < 0.7
            values, _ = ops.topk(tv, k, dim, largest=largest, sorted=True)
            return values, torch.topk(ref, k, dim, largest=largest, sorted=True).values
        if kind == "attention":  # tv the query [..., H, S, E]; causal where the keys are as many
            *lead, s, e = ref.shape
            causal = rng.random() < 0.4
            sk = s if causal else rng.choice(self.extents)
            (k, kref), (v, vref) = self._input((*lead, sk, e)), self._input((*lead, sk, rng.choice(self.extents)))
            return (ops.scaled_dot_product_attention(tv, k, v, is_causal=causal),
                    F.scaled_dot_product_attention(ref, kref, vref, is_causal=causal))
        if kind == "stretch":  # operands with extent-1 dims, broadcast by a binary op or expand
            ones = [d for d in range(tv.ndim) if ref.shape[d] == 1]
            if ones and rng.random() < 0.5:
                shape = [rng.choice(self.extents) if d in ones else e for d, e in enumerate(ref.shape)]
                return ops.expand(tv, shape), ref.expand(shape).contiguous()
            name = rng.choice(BINARY)
            shape = tuple(1 if rng.random() < 0.5 else e for e in ref.shape)
            if ones:  # tv is the one broadcast: the other is larger
                shape = tuple(rng.choice(self.extents) if e == 1 else e for e in ref.shape)
            other, oref = self._input(shape)
            if rng.random() < 0.5:
                return getattr(ops, name)(tv, other), TORCH_BINARY[name](ref, oref)
            return getattr(ops, name)(other, tv), TORCH_BINARY[name](oref, ref)
        if kind == "divide":  # by a tensor away from zero (1 + |other|), or tv the divisor
            shape = tuple(ref.shape) if rng.random() < 0.7 else tuple(ref.shape[-1:])
            other, oref = self._input(shape)
            if rng.random() < 0.6:
                return ops.div(tv, ops.add(ops.abs(other), 1.0)), ref / (oref.abs() + 1.0)
            return ops.div(other, ops.add(ops.abs(tv), 1.0)), oref / (ref.abs() + 1.0)
        if kind == "scan2":
            name, dim = rng.choice(sorted(WIDE_SCANS)), rng.randrange(tv.ndim)
            init = {"init": 0.5} if name == "cumsum" else {}
            return getattr(ops, name)(tv, dim, **init), WIDE_SCANS[name](ref, dim)
        if kind == "native_norm":  # native_layer_norm's y, mean or rstd over the last one or two dims
            ns = list(ref.shape[-rng.randint(1, min(2, tv.ndim - 1)):])
            params = [self._input(tuple(ns)) for _ in range(rng.choice((0, 1, 2)))]
            outs = ops.native_layer_norm(tv, ns, *(p for p, _ in params), eps=1e-5)
            refs = torch.native_layer_norm(ref, ns, *(r for _, r in params), *(None,) * (2 - len(params)), 1e-5)
            which = rng.randrange(3)
            return outs[which], refs[which]
        if kind == "grouped_mm":  # tv [m, k] in g groups of rows by mat2 [g, k, n]: experts
            m, k = ref.shape
            g, n = rng.choice((2, 4)), rng.choice(self.extents)
            w, wref = self._input((g, k, n))
            ends = sorted(rng.randint(0, m) for _ in range(g - 1)) + [m]
            offsets = self.fd.define_tensor([g], dtype=DataType.Int)
            oref = torch.tensor(ends)
            self.inputs.append((offsets, oref))
            self.shapes[offsets.name] = (g,)
            out = torch.cat([ref[a:b] @ wref[i] for i, (a, b) in enumerate(zip([0, *ends[:-1]], ends))])
            return ops.grouped_mm(tv, w, offsets), out
        if kind == "var":
            dim, keep, correction = rng.randrange(tv.ndim), rng.random() < 0.3, rng.choice((0, 1))
            correction = min(correction, ref.shape[dim] - 1)  # not NaN for a dim of extent 1
            return (ops.var(tv, [dim], correction=correction, keepdim=keep),
                    torch.var(ref, dim, correction=correction, keepdim=keep))
        raise AssertionError(kind)

    # --- the schedule -------------------------------------------------------------------------

    def _shard(self, tv) -> None:
        """Replicated on the mesh, or each mesh axis (randomly) sharding a distinct dim it divides, on the
        outer piece of a split (a block shard) or the inner one (a strided shard), or taking the outer
        piece of a reduction axis r{K} (the tensor is then a pending sum on that mesh axis)."""
        rng = self.rng
        mesh = self.mesh if len(self.meshes) == 1 else rng.choice(self.meshes)
        tv.set_device_mesh(mesh)
        self.scheduled.add(tv.name)
        shape = self.shapes[tv.name]  # the concrete extents (tv's may be symbolic)
        if self.wide and mesh.ndim == 2 and rng.random() < 0.15:  # one dim on both mesh axes
            n0, n1 = mesh.shape
            dims = [d for d in range(tv.ndim) if shape[d] % (n0 * n1) == 0]
            if dims:
                d = rng.choice(dims)
                loop = next(i for i, ax in enumerate(tv._loop()) if ax.dim == d and not ax.reduction)
                first = rng.randrange(2)  # the mesh axis on the outer piece
                for i, axis in enumerate((first, 1 - first)):
                    tv.outer_split(loop + i, mesh.shape[axis])
                    tv.axis(loop + i).parallelize(ParallelType.for_mesh_axis(axis, 2))
                return
        split: list[int] = []
        for axis in reversed(range(mesh.ndim)):
            n = mesh.shape[axis]
            reduced = [i for i, ax in enumerate(tv._loop()) if ax.reduction and ax.piece == () and ax.extent % n == 0]
            if reduced and rng.random() < 0.25:
                i = rng.choice(reduced)
                tv.outer_split(i, n)
                tv.axis(i).parallelize(ParallelType.for_mesh_axis(axis, mesh.ndim))
                continue
            dims = [d for d in range(tv.ndim) if d not in split and shape[d] % n == 0]
            if not dims or rng.random() < 0.35:
                continue
            d = rng.choice(dims)
            loop = next(i for i, ax in enumerate(tv._loop()) if ax.dim == d and not ax.reduction)  # past r{}
            strided = rng.random() < 0.3 and shape[d] > n
            tv.split(loop, n, inner_split=strided)
            tv.axis(loop + strided).parallelize(ParallelType.for_mesh_axis(axis, mesh.ndim))
            split.append(d)

    def _other_meshes(self) -> list[DeviceMesh]:
        """Other meshes of the case's devices: listed in another order, halves (pipeline stages), one device,
        and the four devices as a 2-D mesh or a 1-D one (whichever the case's is not)."""
        devs = [int(d) for d in self.mesh.devices]
        half = len(devs) // 2
        out = [DeviceMesh(devs[::-1]), DeviceMesh(devs[:half]), DeviceMesh(devs[half:]),
               DeviceMesh([devs[self.rng.randrange(len(devs))]])]
        if len(devs) == 4:
            out.append(DeviceMesh(devs) if self.mesh.ndim == 2 else DeviceMesh([devs[:2], devs[2:]]))
        return self.rng.sample(out, self.rng.randint(1, 3))

    def _bad_parallel(self, tv) -> None:
        """A loop axis parallelized whose (concrete) extent is not the mesh axis size; "count" where none is."""
        if tv.mesh is None:
            tv.set_device_mesh(self.mesh)
        loop, n = tv._loop(), tv.mesh.shape[-1]
        bad = []
        for i, ax in enumerate(loop):
            if ax.ptype.is_device or ax.reduction:
                continue
            known = math.prod(a.extent for a in loop if a.dim == ax.dim and not a.reduction and a.extent >= 0)
            extent = ax.extent if ax.extent >= 0 else self.shapes[tv.name][ax.dim] // known
            if extent != n:
                bad.append(i)
        if not bad:
            self.error_kind = "count"
            return
        tv.axis(self.rng.choice(bad)).parallelize(ParallelType.for_mesh_axis(tv.mesh.ndim - 1, tv.mesh.ndim))

    def _bad_split(self, tv) -> None:
        """A device split that cannot work: a factor that does not divide, or one not the mesh size."""
        if tv.mesh is None:
            tv.set_device_mesh(self.mesh)
        loop = len(tv._loop()) - 1
        if self.wide and tv._loop()[loop].reduction and tv._loop()[loop].extent < 0:
            # a split of a symbolic reduction axis is not checked against its bound extent (a known gap: loops.bind
            # binds the logical dims only, so it runs): split a logical dim's piece instead
            loop = max(i for i, ax in enumerate(tv._loop()) if not ax.reduction)
        ax = tv._loop()[loop]
        extent = ax.extent
        # A symbolic extent is checked once bound, at execute: the piece's concrete extent here (for a reduction
        # axis 420, which 3, 4, 5 and 7 divide: the factor is then 421, larger than any extent).
        if extent < 0:
            known = [a.extent for a in tv._loop() if a.dim == ax.dim and not a.reduction and a.extent >= 0]
            extent = 420 if ax.reduction else self.shapes[tv.name][ax.dim] // math.prod(known)
        factor = next((f for f in (3, 4, 5, 7) if extent % f), extent + 1)
        tv.outer_split(loop, factor)  # raises: the factor does not divide the extent

    # --- running ------------------------------------------------------------------------------

    def local_inputs(self, rank: int) -> list[torch.Tensor]:
        xs = [shard_tensor(full, tv) for tv, full in self.inputs]
        if self.error_kind == "count":
            return xs[:-1] if len(xs) > 1 else [*xs, xs[0]]
        if self.error_kind in ("shape", "dtype") and rank == self.bad_rank:
            i = self.rng.randrange(len(xs)) if self.bad_input is None else self.bad_input
            x = xs[i]
            if self.error_kind == "dtype":
                xs[i] = x.float()
            elif self.bad_input is None:
                xs[i] = torch.zeros((x.shape[0] + 1, *x.shape[1:]) if x.dim() else (1,), dtype=x.dtype)
            else:  # a defined extent one too large; where every extent is symbolic (a larger one is just another
                #    size where no other rank holds the input to disagree), a dim too many
                fixed = [d for d, e in enumerate(self.inputs[i][0].shape) if e >= 0]
                shape = list(x.shape)
                if fixed:
                    shape[fixed[0]] += 1
                xs[i] = torch.zeros(shape if fixed else [1, *shape], dtype=x.dtype)
        return xs


def _run_case(seed: int, rank: int, world: int, mesh: DeviceMesh, invalid: bool, repeat: bool = False,
              wide: bool = True) -> str:
    """Build and run one case; returns its outcome ("ok" or the error class) after checking it.
    ``repeat``: also run it again (cached plan) and rebuilt (a new plan): bitwise-equal outputs."""
    try:
        case = _Case(seed, mesh, world, invalid, wide)
        xs = case.local_inputs(rank)
        saved = [x.clone() for x in xs]
        outs = case.fd.execute(xs)
    except TPFusionError as e:
        outcome = type(e).__name__
        assert invalid, f"seed {seed}: a valid case raised {outcome}: {e}"
        return outcome
    text = f"seed {seed} on {mesh}\n{case.fd}\n{case.fd.plan}"
    assert not invalid or case.error_kind is None, f"seed {seed}: invalid ({case.error_kind}) ran\n{text}"
    assert len(outs) == len(case.refs), text
    for i, (x, x0) in enumerate(zip(xs, saved)):
        assert torch.equal(x, x0), f"input {i} was modified\n{text}"
    held = {x.untyped_storage().data_ptr() for x in xs if x.numel()}
    aliased = [i for i, o in enumerate(outs) if o.numel() and o.untyped_storage().data_ptr() in held]
    assert not aliased, f"outputs {aliased} alias an input\n{text}"
    for i, (out, ref, sharding) in enumerate(zip(outs, case.refs, case.fd.output_shardings())):
        want = shard_tensor(ref, sharding, rank)
        torch.testing.assert_close(out, want, **case.tol, msg=lambda m, i=i: f"output {i}: {m}\n{text}")
        tv = case.outputs[i]
        if wide and tv.name in case.scheduled:  # as scheduled: the output's annotation holds
            asked = shard_tensor(ref, tv, rank)
            assert out.shape == asked.shape, f"output {i}: {list(out.shape)}, scheduled {list(asked.shape)}\n{text}"
            torch.testing.assert_close(out, asked, **case.tol,
                                       msg=lambda m, i=i: f"output {i} as scheduled: {m}\n{text}")
    if repeat:
        again = case.fd.execute(case.local_inputs(rank))
        fresh = _Case(seed, mesh, world, invalid, wide)
        rebuilt = fresh.fd.execute(fresh.local_inputs(rank))
        for a, b, c in zip(outs, again, rebuilt, strict=True):
            assert torch.equal(a, b) and torch.equal(a, c), f"seed {seed}: outputs differ between runs\n{text}"
    return "ok"


def _rank_fn(rank: int, world: int, cases: list) -> None:
    for i, (seed, devices, invalid, *narrow) in enumerate(cases):
        outcome = _run_case(seed, rank, world, DeviceMesh(devices), invalid, repeat=i % 4 == 0, wide=not narrow)
        outcomes = dist.gather_from_all(outcome)
        # Every rank ran, or every rank raised (a rank may name its own error rather than a peer's).
        assert len({o == "ok" for o in outcomes}) == 1, f"seed {seed}: the ranks disagree: {outcomes}"
        if invalid:
            assert outcome != "ok", f"seed {seed}: an invalid schedule ran"


def _cases(seeds: list[int], meshes: list, invalid_every: int) -> list:
    return [(seed, meshes[i % len(meshes)], i % invalid_every == invalid_every - 1)
            for i, seed in enumerate(seeds)]



MESH_2X2 = [[0, 1], [2, 3]]

# Cases that found bugs (seed, mesh, invalid[, "narrow"]): an allreduce done in place on a permute's view of a
# tensor still in use; a Replicate -> Partial resharding (add of a Partial and a replicated value). Those marked
# "narrow" were found with the op menu before the wide one (``_Case(wide=False)``), and replay with it.
REGRESSIONS_2 = [(5074, [0, 1], False, "narrow"), (5472, [0, 1], False, "narrow")]
REGRESSIONS_4 = [(1286, [0, 1, 2, 3], False, "narrow"), (9113, [[0, 2], [1, 3]], False, "narrow"),
                 (9384, MESH_2X2, False, "narrow")]

# The number of random cases per test (each world size): TP_FUSION_PROPERTY_EXAMPLES=1000 hunts bugs off CI.
EXAMPLES_2 = examples(60)
EXAMPLES_4 = examples(45)


@pytest.mark.ranks(2)
@ONCE
@given(seeds=seeds(EXAMPLES_2))
def test_random_fusions_on_a_1d_mesh(multidevice_test, seeds):
    _rank_fn(multidevice_test.rank, multidevice_test.size, REGRESSIONS_2 + _cases(seeds, [[0, 1]], 4))


@pytest.mark.ranks(4)
@ONCE
@given(seeds=seeds(EXAMPLES_4))
def test_random_fusions_on_2d_and_1d_meshes(multidevice_test, seeds):
    meshes = [MESH_2X2, [0, 1, 2, 3], [[0, 2], [1, 3]]]
    _rank_fn(multidevice_test.rank, multidevice_test.size, REGRESSIONS_4 + _cases(seeds, meshes, 5))
