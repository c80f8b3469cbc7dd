"""Fusions end to end on spawned gloo CPU ranks, against plain torch on the full inputs.

Every rank builds the same seeded full inputs, takes its shard with ``shard_tensor``, executes,
and compares its output with the matching shard of the torch result. Each case also checks the
collectives the plan runs, that the inputs are left untouched and that every rank prints the
same plan. Spawning ranks is slow: the tests take the ``multidevice_test`` fixture, so one set of
ranks per world size runs them all. ``run_cases`` runs them without pytest (tests/gpu/nccl_end_to_end.py).
"""

from __future__ import annotations

import functools
import sys
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from conftest import rand, run_python, shard

from tp_fusion import (
    DataType,
    DeviceMesh,
    FusionDefinition,
    InputError,
    ParallelType,
    ShardingError,
    TensorView,
    shard_tensor,
)
from tp_fusion.launch import run_on_ranks
from tp_fusion.runtime import dist

X, Y = ParallelType.mesh_x, ParallelType.mesh_y
F64, F32 = DataType.Double, DataType.Float


@dataclass
class Case:
    fd: FusionDefinition
    inputs: list[TensorView]  # in definition order
    full: list[torch.Tensor]  # full (unsharded) inputs, identical on every rank
    reference: Callable[..., list[torch.Tensor]]  # full inputs -> full outputs, plain torch
    collectives: list[str]
    # assert_close's tolerances where the outputs' dtype is finer than what computed them (None: its own)
    tolerance: dict | None = None


def _topk_sum(fd, x, k: int, largest: bool):
    """A sorted top-k's values plus its indices (as f64): one output that checks both."""
    values, indices = fd.ops.topk(x, k, 1, largest=largest, sorted=True)
    return fd.ops.add(values, fd.ops.cast(indices, F64))


def _topk_sum_ref(t: torch.Tensor, k: int, largest: bool) -> torch.Tensor:
    values, indices = t.topk(k, 1, largest=largest)
    return values + indices.double()


def _rand(seed: int, shape, dtype: DataType = F64) -> torch.Tensor:
    return rand(seed, *shape, dtype=dtype.torch)


def _unary_case(mesh, shape, src, dst, body, reference, collectives, dtype=F64, seed=0) -> Case:
    """One input ``x`` sharded as ``src``; output ``body(fd, x)`` sharded as ``dst`` (None: unannotated)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape, dtype=dtype)
        z = body(fd, x)
        fd.add_output(z)
        shard(x, mesh, src)
        if dst is not None:
            shard(z, mesh, dst)
    return Case(fd, [x], [_rand(seed, shape, dtype)], lambda t: [reference(t)], collectives)


# --- 1-D mesh cases (any world size; extents divide by 4) ------------------------------------


def reshape_of_middle_piece_case(mesh) -> Case:
    """[4, 16, 3] with dim 1 split [2, 8] and the 8 sharded (``S(1, outer=2)``), reshaped to [4, 2, 8, 3]:
    the split takes the outer factor off, so the piece is a block of dim 2, with no communication."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 16, 3], dtype=F64)
        z = fd.ops.reshape(x, [4, 2, 8, 3])
        fd.add_output(z)
        x.set_device_mesh(mesh)
        x.split(1, 8)
        x.outer_split(2, mesh.size)
        x.axis(2).parallelize(X)
    return Case(fd, [x], [_rand(3, (4, 16, 3))], lambda t: [t.reshape(4, 2, 8, 3)], [])


def slice_of_interleaved_halves_case(mesh, start: int, end: int, collectives: list[str], extent: int = 32) -> Case:
    """[4, 32] with dim 1 split [2, 16] and the 16 sharded (``S(1, outer=2)``: each rank holds a piece of
    both halves, as a fused gate/up weight's activation), sliced on dim 1: whole halves keep their
    pieces, with no communication; a slice across the halves' pieces gathers first. With ``extent`` -1
    (32 at execute), bounds from the end or past it are Python's, as they are on a known extent."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, extent], dtype=F64)
        z = fd.ops.exp(fd.ops.slice(x, [0, start], [4, end]))
        fd.add_output(z)
        x.set_device_mesh(mesh)
        x.split(1, 16)
        x.outer_split(2, mesh.size)
        x.axis(2).parallelize(X)
    return Case(fd, [x], [_rand(4, (4, 32))], lambda t: [t[:, start:end].exp()], collectives)


def linear_case(mesh, kind: str, bias: bool, dtype=F64) -> Case:
    """column: w and b sharded on out features; row: x and w on in features (bias added once);
    rs: row-parallel with the tokens scattered; sp: tokens sharded in, gathered before the GEMM."""
    t, k, n = 8, 12, 16
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([t, k], dtype=dtype), fd.define_tensor([n, k], dtype=dtype)
        b = fd.define_tensor([n], dtype=dtype) if bias else None
        z = fd.ops.linear(x, w, b)
        fd.add_output(z)
        for tv in (x, w, z) + ((b,) if bias else ()):
            shard(tv, mesh)
        if kind == "column":
            shard(w, mesh, {0: X})
            shard(z, mesh, {1: X})
            if bias:
                shard(b, mesh, {0: X})
        elif kind in ("row", "rs"):
            shard(x, mesh, {1: X})
            shard(w, mesh, {1: X})
            if kind == "rs":
                shard(z, mesh, {0: X})
        elif kind == "sp":
            shard(x, mesh, {0: X})
            shard(w, mesh, {0: X})
            shard(z, mesh, {1: X})
    tvs = [x, w] + ([b] if bias else [])
    full = [_rand(i, tv.shape, dtype) for i, tv in enumerate(tvs)]
    expected = {"column": [], "row": ["allreduce"], "rs": ["reduce_scatter"], "sp": ["allgather"]}[kind]
    return Case(fd, tvs, full, lambda *a: [F.linear(*a)], expected)


def gathered_linear_then_cast_case(mesh, to: DataType) -> Case:
    """x gathered (an explicit replicated ``set``) for a linear whose result is cast to another dtype: the
    fused allgather+linear keeps its own dtype and the cast runs after it (the cast was taken into the
    GEMM's epilogue, written into the GEMM's float32 output: the result came back float32)."""
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([8, 4], dtype=F32), fd.define_tensor([4, 4], dtype=F32)
        xr = fd.ops.set(x)
        fd.add_output(fd.ops.cast(fd.ops.linear(xr, w), to))
        shard(x, mesh, {0: X})
        shard(xr, mesh)
        shard(w, mesh)
    full = [_rand(94, (8, 4), F32), _rand(95, (4, 4), F32)]
    # float32 GEMMs of the row chunks and of the whole may round apart (one ulp), whatever the output's dtype
    return Case(fd, [x, w], full, lambda a, b: [F.linear(a, b).to(to.torch)], ["allgather"],
                tolerance={"rtol": 1.3e-6, "atol": 1e-5})


def logical_split_linear_case(mesh, kind: str, bias: bool, dtype=F64) -> Case:
    """nvFuser's logical-split linear: w[4, 16, 12] (b[4, 16]) on x[2, 8, 12] -> [4, 2, 8, 16]. lead: w and
    b sharded on the leading dim; out: on out features; row: x and w on in features (bias added once)."""
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([2, 8, 12], dtype=dtype), fd.define_tensor([4, 16, 12], dtype=dtype)
        b = fd.define_tensor([4, 16], dtype=dtype) if bias else None
        z = fd.ops.linear(x, w, b)
        fd.add_output(z)
        for tv in (x, w) + ((b,) if bias else ()):
            shard(tv, mesh)
        dim = {"lead": 0, "out": 1, "row": 2}[kind]
        shard(w, mesh, {dim: X})
        if kind == "row":
            shard(x, mesh, {2: X})
        elif bias:
            shard(b, mesh, {dim: X})
    tvs = [x, w] + ([b] if bias else [])
    full = [_rand(80 + i, tv.shape, dtype) for i, tv in enumerate(tvs)]

    def reference(x, w, b=None):  # nvFuser's: one linear on the flattened weight, the leading dim first
        y = F.linear(x, w.reshape(-1, 12), None if b is None else b.reshape(-1))
        return [y.reshape(2, 8, 4, 16).permute(2, 0, 1, 3)]
    return Case(fd, tvs, full, reference, ["allreduce"] if kind == "row" else [])


def grouped_mm_case(mesh, kind: str, dtype=F32) -> Case:
    """grouped_mm of x[24, 8] (4 groups of rows, one empty) by w[4, 8, 12]. column: w sharded on n; row:
    x and w on k (an allreduce sums the partial products); experts: w sharded on its groups, each rank
    multiplying the rows of the groups it holds (an allreduce sums them: expert parallelism with the tokens
    on every rank), not every expert's weight gathered."""
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([-1, 8], dtype=dtype), fd.define_tensor([4, 8, 12], dtype=dtype)
        offsets = fd.define_tensor([4], dtype=DataType.Int32)
        z = fd.ops.grouped_mm(x, w, offsets)
        fd.add_output(z)
        for tv in (x, w, offsets):
            shard(tv, mesh)
        if kind == "column":
            shard(w, mesh, {2: X})
        elif kind == "experts":
            shard(w, mesh, {0: X})
        else:
            shard(x, mesh, {1: X})
            shard(w, mesh, {1: X})
    ends = [5, 5, 14, 24]
    full = [_rand(90, (24, 8), dtype), _rand(91, (4, 8, 12), dtype), torch.tensor(ends, dtype=torch.int32)]

    def reference(x, w, offsets):
        sizes = [end - start for start, end in zip([0, *ends[:-1]], ends)]
        return [torch.cat([a @ b for a, b in zip(x.split(sizes), w.unbind())])]
    return Case(fd, [x, w, offsets], full, reference, [] if kind == "column" else ["allreduce"])


def mlp_case(mesh, mode: str, dtype=F64, shape=(8, 8)) -> Case:
    """nanoGPT MLP. tp: replicated in/out; sp: tokens sharded in/out; dp_tp (2-D mesh): batch on
    mesh_y, hidden features on mesh_x."""
    h = shape[-1]
    with FusionDefinition() as fd:
        x = fd.define_tensor(list(shape), dtype=dtype)
        w1, b1 = fd.define_tensor([4 * h, h], dtype=dtype), fd.define_tensor([4 * h], dtype=dtype)
        w2, b2 = fd.define_tensor([h, 4 * h], dtype=dtype), fd.define_tensor([h], dtype=dtype)
        z = fd.ops.linear(fd.ops.gelu(fd.ops.linear(x, w1, b1), approximate="tanh"), w2, b2)
        fd.add_output(z)
        for tv in (x, w1, b1, w2, b2, z):
            shard(tv, mesh)
        for tv in (w1, b1):
            shard(tv, mesh, {0: X})
        shard(w2, mesh, {1: X})
        if mode in ("sp", "dp_tp"):
            tokens = {0: X} if mode == "sp" else {0: Y}
            shard(x, mesh, tokens)
            shard(z, mesh, tokens)
    tvs = [x, w1, b1, w2, b2]
    full = [_rand(10 + i, tv.shape, dtype) * s for i, (tv, s) in enumerate(zip(tvs, (1, 0.3, 0.1, 0.2, 0.1)))]

    def reference(x, w1, b1, w2, b2):
        return [F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)]
    expected = {"tp": ["allreduce"], "sp": ["allgather", "reduce_scatter"], "dp_tp": ["allreduce"]}[mode]
    return Case(fd, tvs, full, reference, expected)


def binary_case(mesh, shapes, shardings, body, reference, collectives, out=None, dtype=F64) -> Case:
    with FusionDefinition() as fd:
        tvs = [fd.define_tensor(s, dtype=dtype) for s in shapes]
        z = body(fd, *tvs)
        fd.add_output(z)
        for tv, sh in zip(tvs, shardings):
            if sh is not None:
                shard(tv, mesh, sh)
        if out is not None:
            shard(z, mesh, out)
    full = [_rand(20 + i, s, dtype) for i, s in enumerate(shapes)]

    def ref(*a):
        r = reference(*a)
        return list(r) if isinstance(r, tuple) else [r]
    return Case(fd, tvs, full, ref, collectives)


def factory_case(mesh) -> Case:
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 4], dtype=F64)
        z = fd.ops.mul(x, fd.ops.full([8, 4], 3.0, F64))
        fd.add_output(z)
        shard(x, mesh, {0: X})
    return Case(fd, [x], [_rand(30, (8, 4))], lambda t: [t * 3.0], [])


def _decomposed_softmax(fd, x):
    """softmax over dim 1 from its parts: exp(x - max) / sum."""
    e = fd.ops.exp(fd.ops.sub(x, fd.ops.max(x, [1], keepdim=True)))
    return fd.ops.div(e, fd.ops.sum(e, [1], keepdim=True))


def vocab_parallel_cross_entropy_case(mesh) -> Case:
    """Megatron's vocab-parallel cross entropy written from fd.ops: the LM head's weight sharded on the
    vocabulary, so the logits are too; the row maxima, the sums of exponentials and the target logits (a
    one-hot from iota) are reduced across ranks, the logits never gathered: three small allreduces."""
    t, h, v = 6, 8, 16
    with FusionDefinition() as fd:
        hidden, w = fd.define_tensor([t, h], dtype=F64), fd.define_tensor([v, h], dtype=F64)
        target = fd.define_tensor([t], dtype=DataType.Int)
        logits = fd.ops.linear(hidden, w)
        m = fd.ops.max(logits, [1], keepdim=True)
        lse = fd.ops.add(fd.ops.log(fd.ops.sum(fd.ops.exp(fd.ops.sub(logits, m)), [1])), fd.ops.squeeze(m, [1]))
        hit = fd.ops.eq(fd.ops.broadcast_in_dim(fd.ops.iota(v), [t, v], [1]),
                        fd.ops.broadcast_in_dim(target, [t, v], [0]))
        picked = fd.ops.sum(fd.ops.where(hit, logits, 0.0), [1])
        fd.add_output(fd.ops.mean(fd.ops.sub(lse, picked), [0]))
        shard(w, mesh, {0: X})
    return Case(fd, [hidden, w, target], [_rand(32, (t, h)), _rand(33, (v, h)), torch.tensor([3, 15, 0, 8, 8, 12])],
                lambda x, weight, tgt: [F.cross_entropy(x @ weight.T, tgt)], ["allreduce"] * 3)


def vocab_parallel_cross_entropy_from_softmax_case(mesh) -> Case:
    """The same loss written with the softmax op and take_along_axis, ``-log(softmax(logits)[target])``: the
    softmax runs as its parts on the logits' vocabulary shards (each row's max and sum allreduced) and each rank
    takes the target probabilities it holds (summed): the logits are never gathered."""
    t, h, v = 6, 8, 16
    with FusionDefinition() as fd:
        hidden, w = fd.define_tensor([t, h], dtype=F64), fd.define_tensor([v, h], dtype=F64)
        target = fd.define_tensor([t, 1], dtype=DataType.Int)
        p = fd.ops.take_along_axis(fd.ops.softmax(fd.ops.linear(hidden, w), 1), target, 1)
        fd.add_output(fd.ops.neg(fd.ops.mean(fd.ops.log(p))))
        shard(w, mesh, {0: X})
    tgt = torch.tensor([[3], [15], [0], [8], [8], [12]])
    return Case(fd, [hidden, w, target], [_rand(32, (t, h)), _rand(33, (v, h)), tgt],
                lambda x, weight, tgt: [F.cross_entropy(x @ weight.T, tgt[:, 0])], ["allreduce"] * 3)


def sp_cross_entropy_backward_case(mesh) -> Case:
    """The gradient of a sequence-parallel vocab-parallel cross entropy with respect to the hidden states,
    (softmax(logits) - one_hot(target)) @ w, with the hidden states, targets and logsumexp on token shards:
    the targets and the logsumexp ([T]) are gathered, not the one-hot and the probabilities ([T, V])."""
    t, h, v = 8, 4, 16
    with FusionDefinition() as fd:
        hidden, w = fd.define_tensor([t, h], dtype=F64), fd.define_tensor([v, h], dtype=F64)
        target, lse = fd.define_tensor([t], dtype=DataType.Int), fd.define_tensor([t], dtype=F64)
        logits = fd.ops.linear(hidden, w)
        hit = fd.ops.eq(fd.ops.broadcast_in_dim(fd.ops.iota(v), [t, v], [1]),
                        fd.ops.broadcast_in_dim(target, [t, v], [0]))
        p = fd.ops.exp(fd.ops.sub(logits, fd.ops.broadcast_in_dim(lse, [t, v], [0])))
        grad_hidden = fd.ops.matmul(fd.ops.sub(p, fd.ops.cast(hit, F64)), w)
        fd.add_output(grad_hidden)
        for tv in (hidden, target, lse, grad_hidden, w):
            shard(tv, mesh, {0: X})
    x, weight = _rand(34, (t, h)), _rand(35, (v, h))
    full = [x, weight, torch.tensor([3, 15, 0, 8, 8, 12, 1, 5]), torch.logsumexp(x @ weight.T, 1)]

    def reference(x, weight, tgt, lse):
        return [(torch.softmax(x @ weight.T, 1) - F.one_hot(tgt, v).double()) @ weight]
    return Case(fd, [hidden, w, target, lse], full, reference, ["allgather"] * 3 + ["reduce_scatter"])


def max_of_a_pending_sum_case(mesh) -> Case:
    """A row-parallel linear's pending sum, then a max the user parallelized over the dim it reduces: the
    sums are reduce_scattered to that dim, each rank takes the max of its piece, and one allreduce of
    the [4] maxima finishes it (before: an allreduce of the [4, 8] sums, then a second of the maxima)."""
    n = mesh.size
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([4, 8], dtype=F64), fd.define_tensor([8, 8], dtype=F64)
        y = fd.ops.linear(x, w)
        m = fd.ops.max(y, [1])
        fd.add_output(m)
        shard(x, mesh, {1: X})
        shard(w, mesh, {1: X})
        for tv in (y, m):  # y: r{K} on mesh_x, a pending sum; m: its reduced dim on mesh_x, a pending max
            tv.set_device_mesh(mesh)
            tv.outer_split(-1 if tv is y else 1, n)
            tv.axis(-2 if tv is y else 1).parallelize(X)
    full = [_rand(90, (4, 8)), _rand(91, (8, 8))]
    return Case(fd, [x, w], full, lambda a, b: [F.linear(a, b).amax(1)], ["reduce_scatter", "allreduce"])


def pending_sum_used_twice_case(mesh, use: str, rows: bool = False) -> Case:
    """A row-parallel linear's pending sum y read by two ops: summed once for both.
    square: sum(y * y); max: y - max(y) (the max needs y summed; the sub reads that sum, not y again);
    rms: RMSNorm of y from primitives. Unannotated, one allreduce; with the result sharded on its rows
    (``rows``), one reduce_scatter, and every op after it runs on the rows."""
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([8, 12], dtype=F64), fd.define_tensor([4, 12], dtype=F64)
        y = fd.ops.linear(x, w)
        if use == "square":
            z = fd.ops.sum(fd.ops.mul(y, y), [1])
        elif use == "rms":
            r = fd.ops.rsqrt(fd.ops.add(fd.ops.mean(fd.ops.mul(y, y), [1]), 1e-5))
            z = fd.ops.mul(y, fd.ops.broadcast_in_dim(r, [8, 4], [0]))
        else:
            z = fd.ops.sub(y, fd.ops.broadcast_in_dim(fd.ops.max(y, [1]), [8, 4], [0]))
        fd.add_output(z)
        shard(x, mesh, {1: X})
        shard(w, mesh, {1: X})
        if rows:
            shard(z, mesh, {0: X})
    references = {
        "square": lambda a, b: [F.linear(a, b).square().sum(1)],
        "rms": lambda a, b: [F.rms_norm(F.linear(a, b), [4], eps=1e-5)],
    }
    reference = references.get(use, lambda a, b: [F.linear(a, b) - F.linear(a, b).amax(1, keepdim=True)])
    return Case(fd, [x, w], [_rand(92, (8, 12)), _rand(93, (4, 12))], reference,
                ["reduce_scatter" if rows else "allreduce"])


def pending_sum_set_and_read_case(mesh, variant: str) -> Case:
    """A row-parallel linear's pending sum y that a user's ``set`` (or a view that is an output) moves and
    ``exp`` reads: summed once. set_then_exp / exp_then_set: the set replicated, recorded before or after
    the exp; permute_then_exp: ``permute(y)`` replicated; rows_then_exp: the set on rows (one
    reduce_scatter, which the exp reads too)."""
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([8, 12], dtype=F64), fd.define_tensor([8, 12], dtype=F64)
        y = fd.ops.linear(x, w)
        if variant == "exp_then_set":
            e = fd.ops.exp(y)
            moved = fd.ops.set(y)
        else:
            moved = fd.ops.permute(y, [1, 0]) if variant == "permute_then_exp" else fd.ops.set(y)
            e = fd.ops.exp(y)
        fd.add_output(moved)
        fd.add_output(e)
        shard(x, mesh, {1: X})
        shard(w, mesh, {1: X})
        shard(moved, mesh, {0: X} if variant == "rows_then_exp" else {})
    t = variant == "permute_then_exp"
    return Case(fd, [x, w], [_rand(96, (8, 12)), _rand(97, (8, 12))],
                lambda a, b: [F.linear(a, b).T if t else F.linear(a, b), F.linear(a, b).exp()],
                ["reduce_scatter" if variant == "rows_then_exp" else "allreduce"])


def pending_sum_in_many_shardings_case(mesh, targets: tuple[dict, ...], collectives: list[str]) -> Case:
    """A row-parallel linear's pending sum y set to each of ``targets`` (one output each, in that order):
    in three shardings, or two of which one is whole, it is summed whole once and sliced for the others
    (a reduce_scatter per sharding would move more); in two shardings on rows and columns, a
    reduce_scatter each (as many bytes as one allreduce)."""
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([8, 12], dtype=F64), fd.define_tensor([8, 12], dtype=F64)
        y = fd.ops.linear(x, w)
        outs = [fd.ops.set(y) for _ in targets]
        for out, target in zip(outs, targets):
            fd.add_output(out)
            shard(out, mesh, target)
        shard(x, mesh, {1: X})
        shard(w, mesh, {1: X})
    return Case(fd, [x, w], [_rand(98, (8, 12)), _rand(99, (8, 12))],
                lambda a, b: [F.linear(a, b)] * len(targets), collectives)


def rms_norm_backward_case(mesh, residual: bool = False, cast: bool = False) -> Case:
    """A sequence-parallel RMSNorm backward's pattern: gy, a row-parallel matmul's pending sum, read by
    grad_x = gy * g (on rows) and grad_g = sum over rows of gy * xhat (xhat on rows). gy is reduce-scattered
    once and both products run on rows; grad_g sums a [H] partial. (Before: an allgather of xhat, an
    allreduce and a reduce_scatter of the product; the pattern comes from a model-pattern hunt.) With
    ``residual``, grad_x is ``gy * g + xhat``, so no op that reads gy has an annotated result. With
    ``cast``, the matmul is f32 and the norm reads its f64 cast: gy is reduce-scattered in f32, half the
    bytes (the inputs are small integers, so that the f32 sums are exact in any order)."""
    gemm = F32 if cast else F64
    with FusionDefinition() as fd:
        a, w = fd.define_tensor([16, 8], dtype=gemm), fd.define_tensor([8, 4], dtype=gemm)
        xhat, g = fd.define_tensor([16, 4], dtype=F64), fd.define_tensor([4], dtype=F64)
        gy = fd.ops.matmul(a, w)
        gy = fd.ops.cast(gy, F64) if cast else gy
        grad_g = fd.ops.sum(fd.ops.mul(gy, xhat), [0])
        grad_x = fd.ops.mul(gy, g)
        grad_x = fd.ops.add(grad_x, xhat) if residual else grad_x
        fd.add_output(grad_x)
        fd.add_output(grad_g)
        shard(a, mesh, {1: X})
        shard(w, mesh, {0: X})
        shard(xhat, mesh, {0: X})
        shard(g, mesh)
        shard(grad_x, mesh, {0: X})
        shard(grad_g, mesh)
    full = [_rand(s, shape) for s, shape in ((85, (16, 8)), (86, (8, 4)), (87, (16, 4)), (88, (4,)))]
    if cast:
        full[:2] = [t.mul(2).round().float() for t in full[:2]]

    def reference(a, w, x, g):
        gy = (a @ w).double()
        return [gy * g + (x if residual else 0), (gy * x).sum(0)]
    return Case(fd, [a, w, xhat, g], full, reference, ["reduce_scatter", "allreduce"])


def sp_embedding_gradient_case(mesh) -> Case:
    """A vocab-parallel embedding's weight gradient in a sequence-parallel backward, one_hot(ids)^T @ grad_h
    with ids and grad_h on token shards and the result on vocabulary shards: ids and grad_h are gathered
    and the one-hot made on the vocabulary shard (Megatron-LM's plan; a reduce_scatter of the [V, H]
    product before)."""
    t, h, v = 8, 4, 32
    with FusionDefinition() as fd:
        ids, grad_h = fd.define_tensor([t], dtype=DataType.Int), fd.define_tensor([t, h], dtype=F64)
        hit = fd.ops.eq(fd.ops.broadcast_in_dim(fd.ops.iota(v), [t, v], [1]),
                        fd.ops.broadcast_in_dim(ids, [t, v], [0]))
        grad_e = fd.ops.matmul(fd.ops.permute(fd.ops.cast(hit, F64), [1, 0]), grad_h)
        fd.add_output(grad_e)
        for tv in (ids, grad_h, grad_e):
            shard(tv, mesh, {0: X})
    full = [torch.tensor([3, 31, 0, 8, 8, 12, 1, 17]), _rand(103, (t, h))]
    return Case(fd, [ids, grad_h], full, lambda i, g: [F.one_hot(i, v).double().T @ g], ["allgather"] * 2)


def index_put_embedding_gradient_case(mesh, ids_dims: dict, grad_dims: dict, out_dims: dict,
                                      collectives: list[str], t: int = 8, v: int = 32) -> Case:
    """An embedding's weight gradient as nvFuser writes it, index_put_accumulate(zeros [V, H], ids, grad_h),
    with repeated ids and negative ones (counting from the end, as in torch)."""
    h = 4
    with FusionDefinition() as fd:
        ids, grad_h = fd.define_tensor([t], dtype=DataType.Int), fd.define_tensor([t, h], dtype=F64)
        grad_e = fd.ops.index_put_accumulate(fd.ops.full([v, h], 0.0, F64), ids, grad_h)
        fd.add_output(grad_e)
        for tv, dims in ((ids, ids_dims), (grad_h, grad_dims), (grad_e, out_dims)):
            shard(tv, mesh, dims)
    ids_full = torch.tensor([3, 31, 0, 8, 8, 12, -1, 17]) if t == 8 else \
        torch.randint(-v, v, (t,), generator=torch.Generator().manual_seed(t))
    full = [ids_full, _rand(107, (t, h))]
    return Case(fd, [ids, grad_h], full,
                lambda i, g: [torch.zeros(v, h, dtype=torch.float64).index_put((i,), g, accumulate=True)], collectives)


def tied_embedding_gradient_case(mesh) -> Case:
    """The TP backward of a tied embedding and LM head (one [V, H] weight on vocabulary shards): the
    embedding's gradient one_hot(ids)^T @ grad_h, grad_h = grad_logits @ W a pending sum, plus the head's
    grad_logits^T @ h. One allreduce of grad_h [T, H], then both products on the vocabulary shard
    (Megatron-LM's plan; a reduce_scatter of the [V, H] product before)."""
    t, h, v = 8, 4, 64
    with FusionDefinition() as fd:
        ids = fd.define_tensor([t], dtype=DataType.Int)
        hn, w, grad_logits = (fd.define_tensor(s, dtype=F64) for s in ([t, h], [v, h], [t, v]))
        grad_h = fd.ops.matmul(grad_logits, w)
        hit = fd.ops.eq(fd.ops.broadcast_in_dim(fd.ops.iota(v), [t, v], [1]),
                        fd.ops.broadcast_in_dim(ids, [t, v], [0]))
        grad_w = fd.ops.add(fd.ops.matmul(fd.ops.permute(fd.ops.cast(hit, F64), [1, 0]), grad_h),
                            fd.ops.matmul(fd.ops.permute(grad_logits, [1, 0]), hn))
        fd.add_output(grad_w)
        shard(ids, mesh)
        shard(hn, mesh)
        for tv, dim in ((w, 0), (grad_logits, 1), (grad_w, 0)):
            shard(tv, mesh, {dim: X})
    full = [torch.tensor([3, 63, 0, 8, 8, 12, 1, 40]), _rand(104, (t, h)), _rand(105, (v, h)), _rand(106, (t, v))]

    def reference(i, hn, w, g):
        return [F.one_hot(i, v).double().T @ (g @ w) + g.T @ hn]
    return Case(fd, [ids, hn, w, grad_logits], full, reference, ["allreduce"])


def replicated_weight_reads_the_gathered_input_case(mesh) -> Case:
    """Under SP, q = linear(x, wq) with wq column-parallel and k = linear(x, wk) with wk replicated and k
    wanted whole: both read the one gathered x (k computed whole), where k was computed on x's token
    shards and gathered too."""
    with FusionDefinition() as fd:
        x, wq, wk = (fd.define_tensor(s, dtype=F64) for s in ([8, 16], [8, 16], [4, 16]))
        q, k = fd.ops.linear(x, wq), fd.ops.linear(x, wk)
        fd.add_output(q)
        fd.add_output(k)
        for tv, dims in ((x, {0: X}), (wq, {0: X}), (wk, {}), (q, {1: X}), (k, {})):
            shard(tv, mesh, dims)
    full = [_rand(s, shape) for s, shape in ((112, (8, 16)), (113, (8, 16)), (114, (4, 16)))]
    return Case(fd, [x, wq, wk], full, lambda x, wq, wk: [x @ wq.T, x @ wk.T], ["allgather"])


def per_token_scales_of_one_tensor_case(mesh) -> Case:
    """Dense expert gating under SP: ``linear(g * s_e, w_e)`` for 3 experts, g [T, H] and each scale s_e [T]
    on token shards, each w_e column-parallel: g is gathered once and each small s_e, and every product
    is made whole from them. Before, each product [T, H] was gathered (each op alone moves less so)."""
    t, h, f, experts = 8, 16, 12, 3
    with FusionDefinition() as fd:
        g = fd.define_tensor([t, h], dtype=F64)
        scales = [fd.define_tensor([t], dtype=F64) for _ in range(experts)]
        weights = [fd.define_tensor([f, h], dtype=F64) for _ in range(experts)]
        outs = [fd.ops.linear(fd.ops.mul(g, fd.ops.broadcast_in_dim(s, [t, h], [0])), w)
                for s, w in zip(scales, weights)]
        for out in outs:
            fd.add_output(out)
        for tv, dims in ((g, {0: X}), *((s, {0: X}) for s in scales), *((w, {0: X}) for w in weights),
                         *((out, {1: X}) for out in outs)):
            shard(tv, mesh, dims)
    full = [_rand(120, (t, h))] + [_rand(121 + e, (t,)) for e in range(experts)] + \
        [_rand(124 + e, (f, h)) for e in range(experts)]

    def reference(g, *rest):
        return [(g * s[:, None]) @ w.T for s, w in zip(rest[:experts], rest[experts:])]
    return Case(fd, [g, *scales, *weights], full, reference, ["allgather"] * (1 + experts))


def residual_then_pending_sums_case(mesh) -> Case:
    """TP attention backward's residual gradient written left to right, ``gy + g1 @ w1 + g2 @ w2`` with each
    product row-parallel (a pending sum): the replicated gy joins the pending sum (a local step), and one
    allreduce sums it all. Before, each product was allreduced where the add met it."""
    t, h, k = 8, 16, 8
    with FusionDefinition() as fd:
        gy, g1, g2, w1, w2 = (fd.define_tensor(s, dtype=F64) for s in ([t, h], [t, k], [t, k], [k, h], [k, h]))
        gx = fd.ops.add(fd.ops.add(gy, fd.ops.matmul(g1, w1)), fd.ops.matmul(g2, w2))
        fd.add_output(gx)
        for tv, dims in ((gy, {}), (g1, {1: X}), (g2, {1: X}), (w1, {0: X}), (w2, {0: X}), (gx, {})):
            shard(tv, mesh, dims)
    full = [_rand(130 + i, shape) for i, shape in enumerate(([t, h], [t, k], [t, k], [k, h], [k, h]))]
    return Case(fd, [gy, g1, g2, w1, w2], full, lambda gy, g1, g2, w1, w2: [gy + g1 @ w1 + g2 @ w2], ["allreduce"])


def sp_residual_then_pending_sums_case(mesh) -> Case:
    """The same residual gradient under SP, gy and gx on token shards, ``gy + g1 @ w1 + g2 @ w2 + g3 @ w3``: the
    chain of adds is regrouped to sum the pending products first, so one reduce_scatter sums them all (before,
    one per product, each meeting gy's shards)."""
    t, h, k = 8, 16, 8
    with FusionDefinition() as fd:
        gy = fd.define_tensor([t, h], dtype=F64)
        gs = [fd.define_tensor([t, k], dtype=F64) for _ in range(3)]
        ws = [fd.define_tensor([k, h], dtype=F64) for _ in range(3)]
        gx = gy
        for g, w in zip(gs, ws):
            gx = fd.ops.add(gx, fd.ops.matmul(g, w))
        fd.add_output(gx)
        for tv, dims in ((gy, {0: X}), (gx, {0: X}), *((g, {1: X}) for g in gs), *((w, {0: X}) for w in ws)):
            shard(tv, mesh, dims)
    full = [_rand(150, [t, h]), *(_rand(151 + i, [t, k]) for i in range(3)),
            *(_rand(154 + i, [k, h]) for i in range(3))]
    return Case(fd, [gy, *gs, *ws], full, lambda gy, *a: [gy + a[0] @ a[3] + a[1] @ a[4] + a[2] @ a[5]],
                ["reduce_scatter"])


def sp_gate_gradient_keeps_the_product_pending_case(mesh) -> Case:
    """A MoE gate's gradient under SP, ``sum(go * y, 1)`` with y a row-parallel product (pending) and go on
    token shards, gathered anyway for the expert's own backward ``go @ w2``: the product runs on that gathered
    copy and stays pending, so only the [T] result is reduce-scattered, not y [T, H]."""
    t, h, f = 8, 16, 16
    with FusionDefinition() as fd:
        go, a, w2 = (fd.define_tensor(shape, dtype=F64) for shape in ([t, h], [t, f], [h, f]))
        gate_grad = fd.ops.sum(fd.ops.mul(go, fd.ops.linear(a, w2)), [1])
        grad_a = fd.ops.matmul(go, w2)
        fd.add_output(gate_grad)
        fd.add_output(grad_a)
        for tv, dims in ((go, {0: X}), (a, {1: X}), (w2, {1: X}), (gate_grad, {0: X}), (grad_a, {1: X})):
            shard(tv, mesh, dims)
    full = [_rand(160, [t, h]), _rand(161, [t, f]), _rand(162, [h, f])]
    return Case(fd, [go, a, w2], full, lambda go, a, w2: [(go * (a @ w2.T)).sum(1), go @ w2],
                ["allgather", "reduce_scatter"])


def where_of_pending_sums_case(mesh, other: str) -> Case:
    """``sum(where(hit, y, other), 1)`` of a row-parallel product ``y`` (a pending sum): where ``other`` is 0, or
    a pending sum too, or replicated (each rank adds it once between them), the where keeps the sum pending,
    and the [T] row sums are allreduced, not y [T, H] (a cross entropy with ignored tokens)."""
    t, h, k = 8, 16, 8
    with FusionDefinition() as fd:
        x, w, r, hit = (fd.define_tensor(shape, dtype=dt) for shape, dt in
                        (([t, k], F64), ([h, k], F64), ([t, h], F64), ([t, h], DataType.Bool)))
        y = fd.ops.linear(x, w)
        b = {"zero": 0.0, "pending": fd.ops.neg(y), "replicated": r}[other]
        fd.add_output(fd.ops.sum(fd.ops.where(hit, y, b), [1]))
        shard(x, mesh, {1: X}), shard(w, mesh, {1: X})
    full = [_rand(170, [t, k]), _rand(171, [h, k]), _rand(172, [t, h]), _rand(173, [t, h]) > 0]

    def reference(x, w, r, hit):
        y = x @ w.T
        return [torch.where(hit, y, {"zero": torch.zeros_like(y), "pending": -y, "replicated": r}[other]).sum(1)]
    return Case(fd, [x, w, r, hit], full, reference, ["allreduce"])


def sp_weight_gradient_accumulated_case(mesh) -> Case:
    """SP weight gradient accumulated into a main_grad and scaled, ``acc + 0.5 * permute(gy) @ x`` with x on
    token shards, gy and acc on features: the annotation passes back through the pointwise ops to the GEMM,
    which gathers x (as with no op after it). Before, gy went through an all_to_all and the [F, H] product
    through a reduce_scatter."""
    t, h, f = 8, 8, 16
    with FusionDefinition() as fd:
        x, gy, acc = (fd.define_tensor(s, dtype=F64) for s in ([t, h], [t, f], [f, h]))
        out = fd.ops.add(acc, fd.ops.mul(fd.ops.matmul(fd.ops.permute(gy, [1, 0]), x), 0.5))
        fd.add_output(out)
        for tv, dims in ((x, {0: X}), (gy, {1: X}), (acc, {0: X}), (out, {0: X})):
            shard(tv, mesh, dims)
    full = [_rand(140 + i, shape) for i, shape in enumerate(([t, h], [t, f], [f, h]))]
    return Case(fd, [x, gy, acc], full, lambda x, gy, acc: [acc + 0.5 * gy.T @ x], ["allgather"])


def fused_qkv_weight_gradient_case(mesh) -> Case:
    """TP backward through a fused QKV weight: ``g = cat([gq, gk, gv], 1)`` of feature-sharded gradients,
    ``gx = g @ wqkv`` and ``gw = permute(g) @ x``, wqkv and gw in the forward's strided layout ([3, n, H/n]
    rows). Each rank holds its blocks of g in that layout already: the cat is local, gw needs nothing and gx
    one allreduce. Before, every piece was gathered and the [3H, H] gradient computed whole on each rank."""
    t, h, n = 8, 8, mesh.size
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([t, h], dtype=F64), fd.define_tensor([3 * h, h], dtype=F64)
        gs = [fd.define_tensor([t, h], dtype=F64) for _ in range(3)]
        g = fd.ops.cat(gs, 1)
        gx, gw = fd.ops.matmul(g, w), fd.ops.matmul(fd.ops.permute(g, [1, 0]), x)
        fd.add_output(gx)
        fd.add_output(gw)
        for tv in (x, gx):
            shard(tv, mesh, {})
        for tv in (w, gw):
            tv.set_device_mesh(mesh)
            tv.outer_split(0, 3)
            tv.outer_split(1, n)
            tv.axis(1).parallelize(X)
        for tv in gs:
            shard(tv, mesh, {1: X})
    full = [_rand(150, (t, h)), _rand(151, (3 * h, h))] + [_rand(152 + i, (t, h)) for i in range(3)]

    def reference(x, w, *gs):
        g = torch.cat(gs, 1)
        return [g @ w, g.T @ x]
    return Case(fd, [x, w, *gs], full, reference, ["allreduce"])


def sp_attention_with_one_kv_head_case(mesh) -> Case:
    """Sequence-parallel grouped-query attention written from matmuls, with one kv head shared by 4 query
    heads (fewer kv heads than ranks: wk and wv replicated): k and v are computed for every token from the
    x gathered for q, and the attention runs on query heads, so x is gathered once and the output
    reduce-scattered (Megatron-LM's plan). Before, k and v stayed on token shards, and q and the
    [heads, T, T] scores were gathered as well."""
    t, h, heads, hd = 8, 16, 4, 4
    with FusionDefinition() as fd:
        x, wq, wk, wv, wo = (fd.define_tensor(s, dtype=F64) for s in
                             ([t, h], [heads * hd, h], [hd, h], [hd, h], [h, heads * hd]))
        q = fd.ops.permute(fd.ops.reshape(fd.ops.linear(x, wq), [t, heads, hd]), [1, 0, 2])

        # [t, hd] -> [heads, t, hd]: the one kv head for every query head
        k, v = (fd.ops.broadcast_in_dim(fd.ops.linear(x, w), [heads, t, hd], [1, 2]) for w in (wk, wv))
        scores = fd.ops.mul(fd.ops.matmul(q, fd.ops.permute(k, [0, 2, 1])), 0.5)
        causal = fd.ops.ge(fd.ops.broadcast_in_dim(fd.ops.iota(t), [t, t], [0]),
                           fd.ops.broadcast_in_dim(fd.ops.iota(t), [t, t], [1]))
        scores = fd.ops.where(fd.ops.broadcast_in_dim(causal, [heads, t, t], [1, 2]), scores, float("-inf"))
        o = fd.ops.matmul(fd.ops.softmax(scores, -1), v)
        y = fd.ops.linear(fd.ops.reshape(fd.ops.permute(o, [1, 0, 2]), [t, heads * hd]), wo)
        fd.add_output(y)
        shard(x, mesh, {0: X})
        shard(wq, mesh, {0: X})
        shard(wk, mesh)
        shard(wv, mesh)
        shard(wo, mesh, {1: X})
        shard(y, mesh, {0: X})
    full = [_rand(s, shape) for s, shape in ((107, (t, h)), (108, (heads * hd, h)), (109, (hd, h)), (110, (hd, h)),
                                             (111, (h, heads * hd)))]

    def reference(x, wq, wk, wv, wo):
        q = (x @ wq.T).reshape(t, heads, hd).transpose(0, 1)
        k, v = (x @ wk.T).expand(heads, t, hd), (x @ wv.T).expand(heads, t, hd)
        return [F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(t, -1) @ wo.T]
    return Case(fd, [x, wq, wk, wv, wo], full, reference, ["allgather", "reduce_scatter"])


def layer_norm_backward_of_a_pending_sum_case(mesh, annotated: bool, written: bool = False) -> Case:
    """A TP layer norm's backward fed by a row-parallel matmul's pending gradient: one allreduce of the
    gradient (before: one of each of grad_x [T, E], grad_w [E] and grad_b [E]), with the three results
    left unannotated (materialized outputs) or given whole; ``native_layer_norm_backward``, or ``written``
    from pointwise ops and means, through which the pending sum flows to the three results. On a 2-D
    mesh the tokens are on mesh_y (DP x TP): still one allreduce of the gradient on mesh_x (before: one of
    grad_x and one of grad_w and grad_b), then grad_w and grad_b are summed over mesh_y."""
    dp = {0: Y} if mesh.ndim == 2 else {}
    t, e, f = 8, 16, 12
    with FusionDefinition() as fd:
        g_h, w, x = (fd.define_tensor(s, dtype=F64) for s in ([t, f], [f, e], [t, e]))
        mean, rstd, lw, lb = (fd.define_tensor(s, dtype=F64) for s in ([t, 1], [t, 1], [e], [e]))
        g = fd.ops.matmul(g_h, w)
        grads = _layer_norm_backward(fd, g, x, mean, rstd, lw) if written else \
            fd.ops.native_layer_norm_backward(g, x, [e], mean, rstd, lw, lb)
        for o in grads:
            fd.add_output(o)
        for tv in (lw, lb, *(grads[1:] if annotated else ())):
            shard(tv, mesh)
        for tv in (x, mean, rstd, *(grads[:1] if annotated else ())):
            shard(tv, mesh, dp)
        shard(g_h, mesh, {1: X, **dp})
        shard(w, mesh, {0: X})
    x_full = _rand(90, (t, e))
    mu = x_full.mean(1, keepdim=True)
    rs = torch.rsqrt(x_full.var(1, unbiased=False, keepdim=True) + 1e-5)
    full = [_rand(91, (t, f)), _rand(92, (f, e)), x_full, mu, rs, 1 + 0.1 * _rand(93, (e,)), _rand(94, (e,))]

    def reference(g_h, w, x, mean, rstd, lw, lb):
        return list(torch.ops.aten.native_layer_norm_backward(g_h @ w, x, [e], mean, rstd, lw, lb, [True] * 3))
    return Case(fd, [g_h, w, x, mean, rstd, lw, lb], full, reference, ["allreduce"] * (3 if dp else 1))


def _layer_norm_backward(fd, g, x, mean, rstd, w):
    """grad_x, grad_w, grad_b of ``layer_norm(x) * w + b`` for the gradient ``g``, from pointwise ops and means."""
    xhat = fd.ops.mul(fd.ops.sub(x, mean), rstd)
    gy = fd.ops.mul(g, w)
    m1, m2 = fd.ops.mean(gy, [1], keepdim=True), fd.ops.mean(fd.ops.mul(gy, xhat), [1], keepdim=True)
    grad_x = fd.ops.mul(rstd, fd.ops.sub(fd.ops.sub(gy, m1), fd.ops.mul(xhat, m2)))
    return grad_x, fd.ops.sum(fd.ops.mul(g, xhat), [0]), fd.ops.sum(g, [0])


def multi_output_case(mesh) -> Case:
    """A mean over a sharded dim (partial sums / global count), an amax (each rank's max, then their max)
    and a replicated-input view of the same tensor, in one fusion."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 8], dtype=F64)
        fd.add_output(fd.ops.mean(x, [1]))
        fd.add_output(fd.ops.amax(x, [1]))
        fd.add_output(fd.ops.neg(x))
        shard(x, mesh, {1: X})
    return Case(fd, [x], [_rand(31, (4, 8))],
                lambda t: [t.mean(1), t.amax(1), -t], ["allreduce", "allreduce"])


CASES_1D: dict[str, Callable[[DeviceMesh], Case]] = {
    "column_linear": lambda m: linear_case(m, "column", False),
    "column_linear_bias": lambda m: linear_case(m, "column", True, F32),
    "row_linear": lambda m: linear_case(m, "row", False, F32),
    "row_linear_bias": lambda m: linear_case(m, "row", True),
    "linear_reduce_scatter": lambda m: linear_case(m, "rs", False),
    "linear_reduce_scatter_bias": lambda m: linear_case(m, "rs", True),
    "sp_linear_allgather": lambda m: linear_case(m, "sp", False),
    "sp_linear_allgather_bias": lambda m: linear_case(m, "sp", True, F32),
    "gathered_linear_cast_to_f64": lambda m: gathered_linear_then_cast_case(m, F64),
    "gathered_linear_cast_to_bf16": lambda m: gathered_linear_then_cast_case(m, DataType.BFloat16),
    "logical_split_linear_lead": lambda m: logical_split_linear_case(m, "lead", False),
    "logical_split_linear_lead_bias": lambda m: logical_split_linear_case(m, "lead", True, F32),
    "logical_split_linear_out_bias": lambda m: logical_split_linear_case(m, "out", True),
    "logical_split_linear_row": lambda m: logical_split_linear_case(m, "row", False),
    "logical_split_linear_row_bias": lambda m: logical_split_linear_case(m, "row", True),
    "grouped_mm_column": lambda m: grouped_mm_case(m, "column"),
    "grouped_mm_row": lambda m: grouped_mm_case(m, "row"),
    "grouped_mm_row_f64": lambda m: grouped_mm_case(m, "row", F64),  # a matmul per group (no torch._grouped_mm)
    "grouped_mm_experts": lambda m: grouped_mm_case(m, "experts"),
    "grouped_mm_experts_f64": lambda m: grouped_mm_case(m, "experts", F64),
    "tp_mlp": lambda m: mlp_case(m, "tp"),
    "tp_mlp_f32": lambda m: mlp_case(m, "tp", F32),
    "sp_mlp": lambda m: mlp_case(m, "sp"),
    "sp_mlp_3d": lambda m: mlp_case(m, "sp", shape=(4, 2, 8)),
    "sp_linear_seq_dim": lambda m: binary_case(
        m, [[2, 8, 4], [12, 4], [12]], [{1: X}, {0: X}, {0: X}],
        lambda fd, x, w, b: fd.ops.relu(fd.ops.linear(x, w, b)), lambda x, w, b: torch.relu(F.linear(x, w, b)),
        ["allgather"]),
    "matmul_batch_broadcast": lambda m: binary_case(
        m, [[4, 8, 4], [4, 8]], [{0: X}, None], lambda fd, a, b: fd.ops.matmul(a, b), torch.matmul, []),
    "where_sharded": lambda m: binary_case(
        m, [[8, 4], [8, 4]], [{0: X}, {0: X}],
        lambda fd, a, b: fd.ops.where(fd.ops.cast(fd.ops.relu(a), DataType.Bool), a, b),
        lambda a, b: torch.where(torch.relu(a).bool(), a, b), []),
    "set_allgather": lambda m: _unary_case(m, [8, 4], {0: X}, {}, lambda fd, x: fd.ops.set(x),
                                           lambda t: t, ["allgather"]),
    "set_allgather_inner_dim": lambda m: _unary_case(m, [2, 8, 3], {1: X}, {}, lambda fd, x: fd.ops.set(x),
                                                     lambda t: t, ["allgather"]),
    "set_slice": lambda m: _unary_case(m, [8, 4], {}, {1: X}, lambda fd, x: fd.ops.set(x), lambda t: t, []),
    "set_all_to_all": lambda m: _unary_case(m, [8, 4], {0: X}, {1: X}, lambda fd, x: fd.ops.set(x),
                                            lambda t: t, ["all_to_all"]),
    "set_all_to_all_back": lambda m: _unary_case(m, [4, 8, 2], {1: X}, {0: X}, lambda fd, x: fd.ops.set(x),
                                                 lambda t: t, ["all_to_all"]),
    "sum_allreduce": lambda m: _unary_case(m, [8, 4], {0: X}, {}, lambda fd, x: fd.ops.sum(x, [0]),
                                           lambda t: t.sum(0), ["allreduce"]),
    "sum_reduce_scatter": lambda m: _unary_case(m, [8, 4], {0: X}, {0: X}, lambda fd, x: fd.ops.sum(x, [0]),
                                                lambda t: t.sum(0), ["reduce_scatter"]),
    "sum_reduce_scatter_inner": lambda m: _unary_case(
        m, [4, 8, 4], {2: X}, {1: X}, lambda fd, x: fd.ops.sum(x, [2]), lambda t: t.sum(2), ["reduce_scatter"]),
    "sum_unsharded_dim": lambda m: _unary_case(m, [8, 4, 3], {0: X}, None, lambda fd, x: fd.ops.sum(x, [1]),
                                               lambda t: t.sum(1), []),
    "sum_then_nonlinear": lambda m: _unary_case(
        m, [8, 4], {0: X}, None, lambda fd, x: fd.ops.exp(fd.ops.mul(fd.ops.sum(x, [0]), 0.5)),
        lambda t: torch.exp(t.sum(0) * 0.5), ["allreduce"]),
    "pointwise_sharded": lambda m: binary_case(
        m, [[8, 4], [8, 4]], [{0: X}, {0: X}], lambda fd, a, b: fd.ops.tanh(fd.ops.mul(fd.ops.add(a, b), 2.0)),
        lambda a, b: torch.tanh((a + b) * 2.0), []),
    "replicated_plus_sharded": lambda m: binary_case(
        m, [[8, 4], [8, 4]], [{1: X}, {}], lambda fd, a, b: fd.ops.sub(a, b), lambda a, b: a - b, []),
    "broadcast_in_dim_sharded": lambda m: _unary_case(
        m, [8], {0: X}, None, lambda fd, x: fd.ops.add(fd.ops.broadcast_in_dim(x, [3, 8], [1]), 1.0),
        lambda t: t.expand(3, 8) + 1.0, []),
    "pointwise_broadcast_sharded": lambda m: binary_case(
        m, [[8, 1], [8, 4]], [{0: X}, None], lambda fd, a, b: fd.ops.mul(a, b), lambda a, b: a * b, []),
    "broadcast_of_replicated": lambda m: binary_case(
        m, [[8, 4], [4]], [{0: X}, None],
        lambda fd, a, b: fd.ops.add(a, fd.ops.broadcast_in_dim(b, [8, 4], [1])), lambda a, b: a + b, []),
    "factory_full": factory_case,
    "reshape_keeps_sharding": lambda m: _unary_case(
        m, [4, 6, 8], {0: X}, None, lambda fd, x: fd.ops.reshape(x, [24, 8]), lambda t: t.reshape(24, 8), []),
    "reshape_split_keeps_sharding": lambda m: _unary_case(
        m, [24, 8], {0: X}, None, lambda fd, x: fd.ops.reshape(x, [4, 6, 8]), lambda t: t.reshape(4, 6, 8), []),
    "reshape_merge_keeps_a_middle_piece": lambda m: _unary_case(  # [3, 8] -> [24]: S(0, outer=3)
        m, [3, 8, 2], {1: X}, None, lambda fd, x: fd.ops.reshape(x, [24, 2]), lambda t: t.reshape(24, 2), []),
    "reshape_merge_and_split_back": lambda m: _unary_case(  # the middle piece is a block again
        m, [3, 8, 2], {1: X}, {1: X}, lambda fd, x: fd.ops.reshape(fd.ops.mul(fd.ops.reshape(x, [24, 2]), 2.0),
                                                                   [3, 8, 2]), lambda t: t * 2, []),
    "reshape_split_off_a_middle_piece": reshape_of_middle_piece_case,
    "slice_of_the_second_interleaved_half": lambda m: slice_of_interleaved_halves_case(m, 16, 32, []),
    "slice_of_both_interleaved_halves": lambda m: slice_of_interleaved_halves_case(m, 0, 32, []),
    "slice_across_interleaved_pieces": lambda m: slice_of_interleaved_halves_case(m, 4, 20, ["allgather"]),
    "slice_of_a_symbolic_interleaved_half_from_the_end": lambda m: slice_of_interleaved_halves_case(
        m, -16, 32, [], extent=-1),
    "slice_of_a_symbolic_interleaved_half_past_the_end": lambda m: slice_of_interleaved_halves_case(
        m, 16, 48, [], extent=-1),
    "reshape_needs_allgather": lambda m: _unary_case(  # a block of 12 // n rows straddles the rows of 4
        m, [12, 2], {0: X}, None, lambda fd, x: fd.ops.reshape(x, [3, 4, 2]), lambda t: t.reshape(3, 4, 2),
        ["allgather"]),
    "softmax_sharded_dim": lambda m: _unary_case(  # run decomposed: each row's max and sum allreduced
        m, [4, 8], {1: X}, None, lambda fd, x: fd.ops.softmax(x, 1), lambda t: torch.softmax(t, 1),
        ["allreduce", "allreduce"]),
    "softmax_sharded_dim_bf16": lambda m: _unary_case(  # wider: bf16 rows gathered would move less than the sums
        m, [4, 32], {1: X}, None, lambda fd, x: fd.ops.softmax(x, 1), lambda t: torch.softmax(t, 1),
        ["allreduce", "allreduce"], dtype=DataType.BFloat16),
    "softmax_other_dim": lambda m: _unary_case(
        m, [4, 8], {0: X}, None, lambda fd, x: fd.ops.softmax(x, 1), lambda t: torch.softmax(t, 1), []),
    "layer_norm_sharded_dim": lambda m: binary_case(  # run as its parts: each row's mean and sum of squares
        m, [[4, 8], [8]], [{1: X}, None], lambda fd, x, w: fd.ops.layer_norm(x, [8], w),
        lambda x, w: F.layer_norm(x, [8], w), ["allreduce", "allreduce"]),
    "mean_amax_multi_output": multi_output_case,
    "gathered_once_for_a_matmul_and_its_transpose": lambda m: binary_case(  # SP MLP backward: g @ w, g^T @ r
        m, [[8, 4], [4, 8], [8, 8]], [{0: X}, {1: X}, {1: X}],
        lambda fd, g, w, r: _outputs(fd, fd.ops.matmul(g, w), fd.ops.matmul(fd.ops.permute(g, [1, 0]), r)),
        lambda g, w, r: (g.T @ r, g @ w), ["allgather"], out={1: X}),
    "weight_gradient_gathers_the_tokens": lambda m: binary_case(  # not all_to_all(grad_a) + reduce_scatter
        m, [[8, 16], [8, 4]], [{1: X}, {0: X}], lambda fd, ga, x: fd.ops.matmul(fd.ops.permute(ga, [1, 0]), x),
        lambda ga, x: ga.T @ x, ["allgather"], out={0: X}),
    "gathered_once_for_a_transpose_then_a_matmul": lambda m: binary_case(  # the same, g^T @ r recorded first
        m, [[8, 4], [4, 8], [8, 8]], [{0: X}, {1: X}, {1: X}],
        lambda fd, g, w, r: _transpose_first(fd, g, w, r),
        lambda g, w, r: (g.T @ r, g @ w), ["allgather"], out={1: X}),
    # the annotated output is the GEMM's cast (f32 master weights): the GEMM still gathers the tokens
    # (not an all_to_all of ga^T and a reduce_scatter of the product)
    "weight_gradient_cast_gathers_the_tokens": lambda m: binary_case(
        m, [[8, 16], [8, 4]], [{1: X}, {0: X}],
        lambda fd, ga, x: fd.ops.cast(fd.ops.matmul(fd.ops.permute(ga, [1, 0]), x), F64),
        lambda ga, x: (ga.T @ x).double(), ["allgather"], out={0: X}, dtype=F32),
    "strided_shards_gathered_once_for_two_readers": lambda m: strided_gathered_once_case(m),
    "gathered_once_for_a_cat_of_it_and_its_negation": lambda m: _unary_case(  # not x and neg(x) each
        m, [8, 4], {0: X}, None, lambda fd, x: fd.ops.cat([x, fd.ops.neg(x)], 0), lambda t: torch.cat([t, -t], 0),
        ["allgather"]),
    "pending_max_summed_once_for_two_readers": lambda m: _unary_case(  # the cat reads the max summed for the sub
        m, [8, 8], {0: X}, {1: X}, _max_and_sum_of_exp,
        lambda t: torch.cat([t.amax(0, keepdim=True), (t - t.amax(0, keepdim=True)).exp().sum(0, keepdim=True)], 1),
        ["allreduce", "allreduce"]),
    "pending_sum_cast_scattered_in_its_dtype": lambda m: rms_norm_backward_case(m, cast=True),
    "unread_outputs_stay_where_made": lambda m: binary_case(  # layer_norm's mean and rstd are not gathered
        m, [[8, 4], [8, 4]], [{}, {0: X}],
        lambda fd, x, r: fd.ops.add(fd.ops.native_layer_norm(x, [4], None, None, eps=1e-5)[0], r),
        lambda x, r: F.layer_norm(x, [4], eps=1e-5) + r, [], out={0: X}),
    # q, k, v and the output sharded on the sequence: the scores keep q's rows, which the softmax over
    # keys takes, so k and v are gathered (not q and the [S, S] scores, then a reduce_scatter)
    "sp_attention_from_matmuls": lambda m: binary_case(
        m, [(8, 4)] * 3, [{0: X}] * 3,
        lambda fd, q, k, v: fd.ops.matmul(fd.ops.softmax(fd.ops.matmul(q, fd.ops.permute(k, [1, 0])), 1), v),
        lambda q, k, v: torch.softmax(q @ k.T, 1) @ v, ["allgather", "allgather"], out={0: X}),
    **{f"pending_sum_{v}": functools.partial(pending_sum_set_and_read_case, variant=v)
       for v in ("set_then_exp", "exp_then_set", "permute_then_exp", "rows_then_exp")},
    "pending_sum_and_its_negation_in_a_lerp": lambda m: binary_case(  # neg reads the sum that lerp needs
        m, [[8, 12], [4, 12]], [{1: X}, {1: X}],
        lambda fd, x, w: _lerp_of_negation(fd, fd.ops.linear(x, w)),
        lambda x, w: torch.lerp(F.linear(x, w), -F.linear(x, w), 0.3), ["allreduce"]),
    "pending_sum_times_its_negation": lambda m: binary_case(  # y summed once; -y of the sum (was 2 allreduces)
        m, [[8, 12], [4, 12]], [{1: X}, {1: X}], lambda fd, x, w: _times_negation(fd, fd.ops.linear(x, w)),
        lambda x, w: F.linear(x, w) * -F.linear(x, w), ["allreduce"]),
    "pending_sum_in_three_shardings": lambda m: pending_sum_in_many_shardings_case(
        m, ({0: X}, {1: X}, {}), ["allreduce"]),
    "pending_sum_whole_and_on_rows": lambda m: pending_sum_in_many_shardings_case(m, ({0: X}, {}), ["allreduce"]),
    "pending_sum_on_rows_and_columns": lambda m: pending_sum_in_many_shardings_case(
        m, ({0: X}, {1: X}), ["reduce_scatter", "reduce_scatter"]),
    "unused_ops_run_nothing": lambda m: _unary_case(  # a softmax over the sharded dim that no output reads
        m, (4, 8), {1: X}, {1: X},
        lambda fd, x: _after_unused(fd, fd.ops.softmax(x, 1), fd.ops.sum(x, [1]), fd.ops.neg(x)),
        torch.neg, []),
    # sdpa on [batch, heads, seq, dim] with the queries' rows sharded: without a causal mask each rank
    # keeps its rows and gathers k and v (or nothing, where they are whole); causal, it gathers q too
    "sdpa_on_query_rows": lambda m: binary_case(
        m, [(2, 2, 8, 4)] * 3, [{2: X}] * 3, lambda fd, q, k, v: fd.ops.scaled_dot_product_attention(q, k, v),
        F.scaled_dot_product_attention, ["allgather", "allgather"], out={2: X}),
    "sdpa_on_query_rows_keys_whole": lambda m: binary_case(
        m, [(2, 2, 8, 4)] * 3, [{2: X}, {}, {}], lambda fd, q, k, v: fd.ops.scaled_dot_product_attention(q, k, v),
        F.scaled_dot_product_attention, [], out={2: X}),
    "causal_sdpa_on_query_rows": lambda m: binary_case(
        m, [(2, 2, 8, 4)] * 3, [{2: X}] * 3,
        lambda fd, q, k, v: fd.ops.scaled_dot_product_attention(q, k, v, is_causal=True),
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), ["allgather"] * 3, out={2: X}),
    "per_token_scale_gathered_before_it_grows": lambda m: binary_case(  # gathers s [T], not the product [T, H]
        m, [[8], [8, 16]], [{0: X}, {}],
        lambda fd, s, y: fd.ops.mul(y, fd.ops.broadcast_in_dim(s, [8, 16], [0])),
        lambda s, y: y * s[:, None], ["allgather"], out={}),
    "layer_norm_backward_of_a_pending_sum": lambda m: layer_norm_backward_of_a_pending_sum_case(m, False),
    "layer_norm_backward_of_a_pending_sum_whole": lambda m: layer_norm_backward_of_a_pending_sum_case(m, True),
    "written_layer_norm_backward_of_a_pending_sum": lambda m: layer_norm_backward_of_a_pending_sum_case(
        m, False, written=True),
    "sp_cross_entropy_backward_gathers_the_targets": sp_cross_entropy_backward_case,
    "sp_embedding_gradient_gathers_the_tokens": sp_embedding_gradient_case,
    "tied_embedding_gradient_sums_grad_h": tied_embedding_gradient_case,
    # index_put_accumulate from token shards: onto vocabulary shards, ids and grad_h are gathered and each rank
    # adds the rows it holds; replicated, each rank sums its tokens into a partial table (one allreduce); a
    # hidden shard of grad_h passes through
    "index_put_accumulate_onto_vocabulary_shards": lambda m: index_put_embedding_gradient_case(
        m, {0: X}, {0: X}, {0: X}, ["allgather", "allgather"]),
    "index_put_accumulate_partial_table": lambda m: index_put_embedding_gradient_case(
        m, {0: X}, {0: X}, {}, ["allreduce"]),
    "index_put_accumulate_hidden_shards": lambda m: index_put_embedding_gradient_case(m, {}, {1: X}, {1: X}, []),
    # a table smaller than the tokens' gradients: each rank sums its tokens into a partial table, reduce_scattered
    "index_put_accumulate_small_table_reduce_scatters": lambda m: index_put_embedding_gradient_case(
        m, {0: X}, {0: X}, {0: X}, ["reduce_scatter"], t=64, v=8),
    "sp_attention_with_one_kv_head_gathers_x_once": sp_attention_with_one_kv_head_case,
    "replicated_weight_reads_the_gathered_input": replicated_weight_reads_the_gathered_input_case,
    "per_token_scales_gather_the_tensor_once": per_token_scales_of_one_tensor_case,
    "vocab_parallel_cross_entropy_from_softmax": vocab_parallel_cross_entropy_from_softmax_case,
    "sp_residual_then_pending_sums_reduce_scattered_once": sp_residual_then_pending_sums_case,
    "maximum_of_pending_maxima_allreduced_once": lambda m: binary_case(  # a loss scaler's overflow check
        m, [[8, 4], [8, 4]], [{1: X}, {1: X}], lambda fd, a, b: fd.ops.maximum(fd.ops.max(a, [1]), fd.ops.max(b, [1])),
        lambda a, b: torch.maximum(a.amax(1), b.amax(1)), ["allreduce"]),
    "minimum_of_pending_minima_allreduced_once": lambda m: binary_case(
        m, [[8, 4], [8, 4]], [{1: X}, {1: X}], lambda fd, a, b: fd.ops.minimum(fd.ops.min(a, [1]), fd.ops.min(b, [1])),
        lambda a, b: torch.minimum(a.amin(1), b.amin(1)), ["allreduce"]),
    "where_of_a_pending_sum_and_zero": lambda m: where_of_pending_sums_case(m, "zero"),
    "where_of_two_pending_sums": lambda m: where_of_pending_sums_case(m, "pending"),
    "where_of_a_pending_sum_and_a_replicated_tensor": lambda m: where_of_pending_sums_case(m, "replicated"),
    "sp_gate_gradient_keeps_the_product_pending": sp_gate_gradient_keeps_the_product_pending_case,
    "residual_then_pending_sums_allreduced_once": residual_then_pending_sums_case,
    "sp_weight_gradient_accumulated_gathers_x": sp_weight_gradient_accumulated_case,
    "fused_qkv_weight_gradient_cat_is_local": fused_qkv_weight_gradient_case,
    "rms_norm_backward_sums_gy_once": rms_norm_backward_case,
    "rms_norm_backward_with_residual_sums_gy_once": lambda m: rms_norm_backward_case(m, residual=True),
    "pending_sum_squared": lambda m: pending_sum_used_twice_case(m, "square"),
    "pending_sum_minus_its_max": lambda m: pending_sum_used_twice_case(m, "max"),
    "pending_sum_minus_its_max_scattered": lambda m: pending_sum_used_twice_case(m, "max", rows=True),
    "pending_sum_rms_norm": lambda m: pending_sum_used_twice_case(m, "rms"),
    "pending_sum_rms_norm_scattered": lambda m: pending_sum_used_twice_case(m, "rms", rows=True),
    "row_linear_bias_scatter_features": lambda m: row_bias_scatter_case(m),
    "var_mean_sharded_dim": lambda m: _unary_case(  # run as its parts: each row's mean and sum of squares
        m, [4, 8], {1: X}, None, lambda fd, x: fd.ops.var_mean(x, [1])[0], lambda t: t.var(1),
        ["allreduce", "allreduce"]),
    "var_mean_both_outputs_keepdim_bf16": lambda m: _unary_case(
        m, [4, 32], {1: X}, None, lambda fd, x: fd.ops.add(*fd.ops.var_mean(x, [1], 0, True)),
        lambda t: torch.add(*torch.var_mean(t, 1, correction=0, keepdim=True)), ["allreduce", "allreduce"],
        dtype=DataType.BFloat16),
    "mean_keepdim_reduce_scatter": lambda m: _unary_case(
        m, [8, 4], {0: X}, {1: X}, lambda fd, x: fd.ops.mean(x, [0], keepdim=True),
        lambda t: t.mean(0, keepdim=True), ["reduce_scatter"]),
    "permute_then_gather": lambda m: _unary_case(
        m, [8, 4, 2], {0: X}, {}, lambda fd, x: fd.ops.permute(x, [1, 0, 2]), lambda t: t.permute(1, 0, 2),
        ["allgather"]),
    "partial_through_reshape_and_cast": lambda m: _unary_case(
        m, [8, 4, 2], {0: X}, None,
        lambda fd, x: fd.ops.cast(fd.ops.reshape(fd.ops.sum(x, [0]), [8]), F64), lambda t: t.sum(0).reshape(8).double(),
        ["allreduce"], dtype=F32),
    "squeeze_unsqueeze_sharded": lambda m: _unary_case(
        m, [8, 1, 4], {0: X}, None, lambda fd, x: fd.ops.unsqueeze(fd.ops.squeeze(x, [1]), 2),
        lambda t: t.squeeze(1).unsqueeze(2), []),
    "matmul_sharded_k": lambda m: binary_case(
        m, [[2, 8, 4], [4, 8]], [{2: X}, {0: X}], lambda fd, a, b: fd.ops.matmul(a, b), torch.matmul,
        ["allreduce"]),
    "matmul_sharded_n": lambda m: binary_case(
        m, [[8, 4], [4, 8]], [None, {1: X}], lambda fd, a, b: fd.ops.matmul(a, b), torch.matmul, []),
    "intermediate_output_reused": lambda m: binary_case(
        m, [[8, 4], [8, 4]], [{0: X}, None], lambda fd, a, b: _two_outputs(fd, a, b),
        lambda a, b: (a + b, (a + b) * 2.0), []),
}


def strided_gathered_once_case(mesh) -> Case:
    """x strided-sharded on its columns, read by a row-parallel linear (on block shards) and by a cat
    (whole): the one allgather of x serves both (it ran twice before)."""
    n = mesh.size
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([8, 16], dtype=F64), fd.define_tensor([6, 16], dtype=F64)
        fd.add_output(fd.ops.cat([fd.ops.linear(x, w), x], 1))
        x.set_device_mesh(mesh)
        x.inner_split(1, n)
        x.axis(2).parallelize(X)
        shard(w, mesh, {1: X})
    full = [_rand(95, (8, 16)), _rand(96, (6, 16))]
    return Case(fd, [x, w], full, lambda a, b: [torch.cat([F.linear(a, b), a], 1)], ["allgather", "allreduce"])


def _max_and_sum_of_exp(fd, x):
    """``cat([m, sum(exp(x - m))])`` for the column max ``m``, which two ops read: a pending max on rows."""
    m = fd.ops.amax(x, [0], keepdim=True)
    return fd.ops.cat([m, fd.ops.sum(fd.ops.exp(fd.ops.sub(x, m)), [0], keepdim=True)], 1)


def _outputs(fd, first, *more):
    """``first``, with ``more`` added as outputs before it (binary_case adds the one it returns)."""
    for tv in more:
        fd.add_output(tv)
    return first


def _lerp_of_negation(fd, y):
    """lerp(y, -y, 0.3): the lerp needs y summed; -y of the pending sum reads that sum (two allreduces before:
    one of y, one of -y)."""
    return fd.ops.lerp(y, fd.ops.neg(y), 0.3)


def _times_negation(fd, y):
    """y * neg(y): both operands carry y's pending sum, so y is summed once and neg reads the sum (two
    allreduces before: one of y, one of -y)."""
    return fd.ops.mul(y, fd.ops.neg(y))


def _after_unused(fd, *ops):
    """The last of ``ops``; the others are recorded and read by nothing."""
    return ops[-1]


def _transpose_first(fd, g, w, r):
    """``g^T @ r`` (an output), then ``g @ w``: the permute comes before the op that gathers ``g``."""
    grad_w = fd.ops.matmul(fd.ops.permute(g, [1, 0]), r)
    fd.add_output(grad_w)
    return fd.ops.matmul(g, w)


def _two_outputs(fd, a, b):
    s = fd.ops.add(a, b)
    fd.add_output(s)  # s is an output and feeds the next op
    return fd.ops.mul(s, 2.0)


def row_bias_scatter_case(mesh) -> Case:
    """Row-parallel linear with bias whose out features are scattered: reduce_scatter on the last
    dim, then the bias's local slice added once."""
    with FusionDefinition() as fd:
        x, w, b = (fd.define_tensor(s, dtype=F64) for s in ([8, 12], [16, 12], [16]))
        z = fd.ops.linear(x, w, b)
        fd.add_output(z)
        shard(x, mesh, {1: X})
        shard(w, mesh, {1: X})
        shard(b, mesh)
        shard(z, mesh, {1: X})
    full = [_rand(50 + i, tv.shape) for i, tv in enumerate((x, w, b))]
    return Case(fd, [x, w, b], full, lambda *a: [F.linear(*a)], ["reduce_scatter"])


# --- nvFuser's other ops on a 1-D mesh: where their dims may stay sharded -------------------------


def _indexed_case(mesh, x_shape, x_dims, idx_full, idx_dims, body, reference, collectives, out=None) -> Case:
    """``body(fd, x, idx)`` of a float input x and an integer input idx (its full value given)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(x_shape, dtype=F64)
        idx = fd.define_tensor(list(idx_full.shape), dtype=DataType.Int)
        z = body(fd, x, idx)
        fd.add_output(z)
        shard(x, mesh, x_dims)
        shard(idx, mesh, idx_dims)
        if out is not None:
            shard(z, mesh, out)
    return Case(fd, [x, idx], [_rand(60, x_shape), idx_full], lambda a, i: [reference(a, i)], collectives)


def attention_bias_mask_case(mesh, q_dims: dict, kv_dims: dict, bias_shape, mask_shape) -> Case:
    """sdpfa_fwd of q, k, v [2, 4, 8, 4] sharded as ``q_dims`` and ``kv_dims`` with a bias and a Bool mask of these
    shapes, unannotated: the plan shards them as q where they span q's sharded dim (locally sliced, no collective)."""
    with FusionDefinition() as fd:
        q, k, v = (fd.define_tensor([2, 4, 8, 4], dtype=F64) for _ in range(3))
        bias, mask = fd.define_tensor(bias_shape, dtype=F64), fd.define_tensor(mask_shape, dtype=DataType.Bool)
        fd.add_output(fd.ops.sdpfa_fwd(q, k, v, bias, mask)[0])
        shard(q, mesh, q_dims)
        for t in (k, v):
            shard(t, mesh, kv_dims)
    full = [_rand(70 + i, (2, 4, 8, 4)) for i in range(3)]
    full += [_rand(73, bias_shape), torch.rand(mask_shape, generator=torch.Generator().manual_seed(74)) > 0.3]

    def reference(q, k, v, b, m):
        return [F.scaled_dot_product_attention(q, k, v, attn_mask=b + torch.where(m, 0.0, float("-inf")))]
    return Case(fd, [q, k, v, bias, mask], full, reference, [])


_INDEX = torch.tensor([5, 0, 3, 3, 1, 2, 0, 4])
_TOKENS = torch.tensor([[7, 1, 0], [9, 9, 2], [3, 4, 5], [0, 8, 6]])
_ALONG = torch.tensor([[5, 0, 3], [1, 1, 2], [0, 4, 5], [2, 3, 1], [4, 4, 0], [3, 5, 1], [0, 2, 5], [1, 0, 4]])
_DISTINCT = torch.tensor([[5, 0, 3], [1, 4, 2], [0, 4, 5], [2, 3, 1], [4, 1, 0], [3, 5, 1], [0, 2, 5], [1, 0, 4]])
_VOCAB_TOKENS = torch.tensor([[11, 1, 0], [9, 9, 2], [3, 4, 5], [0, 8, 6]])  # into 12 rows

CASES_OPS: dict[str, Callable[[DeviceMesh], Case]] = {
    "cumsum_other_dim": lambda m: _unary_case(m, [8, 4], {0: X}, None, lambda fd, x: fd.ops.cumsum(x, 1),
                                              lambda t: t.cumsum(1), []),
    "cumsum_sharded_dim": lambda m: _unary_case(m, [4, 8], {1: X}, None, lambda fd, x: fd.ops.cumprod(x, 1),
                                                lambda t: t.cumprod(1), ["allgather"]),
    # a scan of sequence shards (an SSM's): each rank scans its block, the blocks' totals are gathered and
    # scanned, and each block adds (multiplies) the totals before it; only [3, d, 1, 4] moves, not the input
    "cumsum_sharded_dim_chunked": lambda m: _unary_case(
        m, [3, 16, 4], {1: X}, None, lambda fd, x: fd.ops.cumsum(x, 1), lambda t: t.cumsum(1), ["allgather"]),
    "cumprod_sharded_dim_chunked_init": lambda m: _unary_case(
        m, [3, 16, 4], {1: X}, None, lambda fd, x: fd.ops.cumprod(fd.ops.add(x, 0.5), 1, 2.0),
        lambda t: (t + 0.5).cumprod(1) * 2.0, ["allgather"]),
    "cumsum_of_a_partial_sum": lambda m: _unary_case(
        m, [8, 4], {0: X}, None, lambda fd, x: fd.ops.cumsum(fd.ops.sum(x, [0]), 0),
        lambda t: t.sum(0).cumsum(0), ["allreduce"]),
    # max, min and prod over a sharded dim: each rank reduces its piece, then one allreduce of that op
    "max_sharded_dim": lambda m: _unary_case(m, [4, 8], {1: X}, None, lambda fd, x: fd.ops.max(x, [1]),
                                             lambda t: t.amax(1), ["allreduce"]),
    "min_sharded_dim_keepdim": lambda m: _unary_case(
        m, [4, 8], {1: X}, None, lambda fd, x: fd.ops.min(x, [1], keepdim=True), lambda t: t.amin(1, keepdim=True),
        ["allreduce"]),
    "prod_sharded_dim": lambda m: _unary_case(m, [4, 8], {1: X}, None, lambda fd, x: fd.ops.prod(x, [1]),
                                              lambda t: t.prod(1), ["allreduce"]),
    "max_of_a_pending_max": lambda m: _unary_case(  # the second max keeps the first's pending max
        m, [4, 8], {1: X}, None, lambda fd, x: fd.ops.max(fd.ops.max(x, [1]), [0]), lambda t: t.amax(), ["allreduce"]),
    "max_reduce_scatter": lambda m: _unary_case(
        m, [8, 8], {1: X}, {0: X}, lambda fd, x: fd.ops.max(x, [1]), lambda t: t.amax(1), ["reduce_scatter"]),
    "max_of_a_pending_sum": max_of_a_pending_sum_case,
    "max_then_sum_of_it": lambda m: _unary_case(  # exp is not linear: the pending max is done first
        m, [4, 8], {1: X}, None, lambda fd, x: fd.ops.sum(fd.ops.exp(fd.ops.max(x, [1])), [0]),
        lambda t: t.amax(1).exp().sum(0), ["allreduce"]),
    # softmax over a sharded vocabulary (Megatron's vocab-parallel cross entropy): the logits stay sharded,
    # only the row maxima and the row sums are reduced across ranks
    "vocab_parallel_cross_entropy": vocab_parallel_cross_entropy_case,
    "vocab_parallel_softmax": lambda m: _unary_case(
        m, [4, 8], {1: X}, {1: X}, _decomposed_softmax, lambda t: torch.softmax(t, 1), ["allreduce", "allreduce"]),
    "min_prod_var_other_dim": lambda m: _unary_case(
        m, [8, 4], {0: X}, {0: X},
        lambda fd, x: fd.ops.add(fd.ops.min(x, 1), fd.ops.mul(fd.ops.prod(x, [1]), fd.ops.var(x, [1]))),
        lambda t: t.amin(1) + t.prod(1) * t.var(1), []),
    "pad_other_dim": lambda m: _unary_case(m, [8, 4], {0: X}, None, lambda fd, x: fd.ops.pad(x, [1, 2], 0.5),
                                           lambda t: F.pad(t, [1, 2], value=0.5), []),
    "pad_sharded_dim": lambda m: _unary_case(m, [8, 4], {0: X}, None, lambda fd, x: fd.ops.pad(x, [0, 0, 2, 1]),
                                             lambda t: F.pad(t, [0, 0, 2, 1]), ["allgather"]),
    "triu_batch_sharded": lambda m: _unary_case(m, [4, 6, 6], {0: X}, None, lambda fd, x: fd.ops.triu(x, 1),
                                                lambda t: torch.triu(t, 1), []),
    "ternary_pointwise_sharded": lambda m: binary_case(
        m, [[8, 4], [8, 4], [4]], [{0: X}, {0: X}, None],
        lambda fd, a, b, c: fd.ops.clamp(fd.ops.addcmul(fd.ops.lerp(a, b, 0.25), a, c, 2.0), -1.0, 1.5),
        lambda a, b, c: torch.clamp(torch.addcmul(torch.lerp(a, b, 0.25), a, c, value=2.0), -1.0, 1.5), []),
    "unary_math_sharded": lambda m: _unary_case(
        m, [8, 4], {1: X}, None, lambda fd, x: fd.ops.atan2(fd.ops.erf(x), fd.ops.cos(fd.ops.expm1(x))),
        lambda t: torch.atan2(torch.erf(t), torch.cos(torch.expm1(t))), []),
    "iota_plus_sharded": lambda m: _unary_case(
        m, [8], {0: X}, None, lambda fd, x: fd.ops.mul(x, fd.ops.iota(8, 1, 2, F64)),
        lambda t: t * torch.arange(1, 17, 2, dtype=torch.float64), []),
    "index_select_sharded_index": lambda m: _indexed_case(
        m, [6, 4], {}, _INDEX, {0: X}, lambda fd, x, i: fd.ops.index_select(x, i, 0),
        lambda a, i: a.index_select(0, i), [], out={0: X}),
    "index_select_x_sharded_other_dim": lambda m: _indexed_case(
        m, [6, 8], {1: X}, _INDEX, {}, lambda fd, x, i: fd.ops.index_select(x, i, 0),
        lambda a, i: a.index_select(0, i), []),
    # x sharded along the dim it is indexed on: each rank takes the rows it holds (zeros for the others), summed
    "index_select_x_sharded_indexed_dim": lambda m: _indexed_case(
        m, [8, 4], {0: X}, _INDEX, {}, lambda fd, x, i: fd.ops.index_select(x, i, 0),
        lambda a, i: a.index_select(0, i), ["allreduce"]),
    "index_select_vocab_sharded_tokens_scattered": lambda m: _indexed_case(
        m, [48, 4], {0: X}, _INDEX * 9, {}, lambda fd, x, i: fd.ops.index_select(x, i, 0),
        lambda a, i: a.index_select(0, i), ["reduce_scatter"], out={0: X}),
    "embedding_hidden_sharded": lambda m: _indexed_case(
        m, [10, 8], {1: X}, _TOKENS, {}, lambda fd, w, i: fd.ops.embedding_fwd(i, w),
        lambda w, i: F.embedding(i, w), []),
    # a sharded vocabulary: each rank looks up the rows it holds (zeros for the others), then one collective
    "embedding_vocab_sharded": lambda m: _indexed_case(
        m, [12, 8], {0: X}, _VOCAB_TOKENS, {}, lambda fd, w, i: fd.ops.embedding_fwd(i, w),
        lambda w, i: F.embedding(i, w), ["allreduce"]),
    "embedding_vocab_sharded_tokens_scattered": lambda m: _indexed_case(
        m, [12, 8], {0: X}, _VOCAB_TOKENS, {}, lambda fd, w, i: fd.ops.embedding_fwd(i, w, padding_idx=3),
        lambda w, i: F.embedding(i, w, padding_idx=3), ["reduce_scatter"], out={0: X}),
    "embedding_vocab_and_tokens_sharded": lambda m: _indexed_case(  # the table (larger) stays sharded: the ids move
        m, [48, 8], {0: X}, _VOCAB_TOKENS, {0: X}, lambda fd, w, i: fd.ops.embedding_fwd(i, w),
        lambda w, i: F.embedding(i, w), ["allgather", "reduce_scatter"], out={0: X}),
    "embedding_vocab_sharded_max_norm": lambda m: _indexed_case(
        m, [12, 8], {0: X}, _VOCAB_TOKENS, {}, lambda fd, w, i: fd.ops.embedding_fwd(i, w, None, 1.0),
        lambda w, i: F.embedding(i, w.clone(), max_norm=1.0), ["allreduce"]),
    # take_along_axis / gather / scatter: a shard of the index (and of arg's dims it spans alike) stays put
    "take_along_axis_rows_sharded": lambda m: _indexed_case(
        m, [8, 6], {0: X}, _ALONG, {0: X}, lambda fd, x, i: fd.ops.take_along_axis(x, i, 1),
        lambda x, i: torch.gather(x, 1, i), []),
    "take_along_axis_dim_sharded": lambda m: _indexed_case(  # a cross entropy's target logits: not the logits moved
        m, [8, 8], {1: X}, _ALONG, {}, lambda fd, x, i: fd.ops.take_along_axis(x, i, 1),
        lambda x, i: torch.gather(x, 1, i), ["allreduce"]),
    "gather_dim_sharded_prefix_of_rows": lambda m: _indexed_case(
        m, [8, 8], {1: X}, _ALONG[:4], {}, lambda fd, x, i: fd.ops.gather(x, i, 1),
        lambda x, i: torch.gather(x, 1, i), ["allreduce"]),
    "gather_prefix_of_rows": lambda m: _indexed_case(  # the index spans 4 of 8 rows: the rows of both gathered
        m, [8, 6], {0: X}, _ALONG[:4], {0: X}, lambda fd, x, i: fd.ops.gather(x, i, 1),
        lambda x, i: torch.gather(x, 1, i), ["allgather", "allgather"]),
    "scatter_rows_sharded": lambda m: _indexed_case(  # distinct indices per row: no write races another
        m, [8, 6], {0: X}, _DISTINCT, {0: X}, lambda fd, x, i: fd.ops.scatter(x, i, fd.ops.neg(fd.ops.slice(
            x, [0, 0], [8, 3])), 1), lambda x, i: torch.scatter(x, 1, i, -x[:, :3]), []),
    "scatter_dim_sharded": lambda m: _indexed_case(
        m, [8, 8], {1: X}, _ALONG, {}, lambda fd, x, i: fd.ops.scatter(x, i, 2.5, 1),
        lambda x, i: torch.scatter(x, 1, i, 2.5), ["allgather"]),
    "topk_argsort_other_dim": lambda m: _unary_case(
        m, [8, 6], {0: X}, None, lambda fd, x: fd.ops.add(fd.ops.topk(x, 2, 1, sorted=True)[0],
                                                           fd.ops.cast(fd.ops.slice(fd.ops.argsort(x, 1), [0, 0],
                                                                                    [8, 2]), F64)),
        lambda t: t.topk(2, 1).values + t.argsort(1)[:, :2].double(), []),
    # a sorted top-k of vocabulary-sharded logits: each rank's top 3, gathered (4 x 3 per rank), their top 3, and
    # the winners' global indices summed from the rank that holds each (zeros elsewhere); unsorted, it gathers
    "topk_sharded_dim_two_stage": lambda m: _unary_case(
        m, [4, 64], {1: X}, None, lambda fd, x: _topk_sum(fd, x, 3, True), lambda t: _topk_sum_ref(t, 3, True),
        ["allgather", "allreduce"]),
    "topk_sharded_dim_two_stage_smallest": lambda m: _unary_case(
        m, [4, 64], {1: X}, None, lambda fd, x: _topk_sum(fd, x, 3, False), lambda t: _topk_sum_ref(t, 3, False),
        ["allgather", "allreduce"]),
    "topk_sharded_dim_unsorted_gathers": lambda m: _unary_case(  # summed: the order is the device's kernel's
        m, [4, 64], {1: X}, None, lambda fd, x: fd.ops.sum(fd.ops.topk(x, 3, 1, sorted=False)[0], [1]),
        lambda t: t.topk(3, 1).values.sum(1), ["allgather"]),
    "topk_sharded_dim": lambda m: _unary_case(
        m, [4, 8], {1: X}, None, lambda fd, x: fd.ops.topk(x, 3, 1, largest=False, sorted=True)[1],
        lambda t: t.topk(3, 1, largest=False).indices, ["allgather"]),
    "embedding_hidden_sharded_max_norm": lambda m: _indexed_case(  # a row's norm needs all of it: h gathered
        m, [10, 8], {1: X}, _TOKENS, {}, lambda fd, w, i: fd.ops.embedding_fwd(i, w, None, 1.0),
        lambda w, i: F.embedding(i, w.clone(), max_norm=1.0), ["allgather"]),
    "embedding_tokens_sharded": lambda m: _indexed_case(
        m, [10, 8], {}, _TOKENS, {0: X}, lambda fd, w, i: fd.ops.embedding_fwd(i, w),
        lambda w, i: F.embedding(i, w), []),
    "select_other_dim": lambda m: _unary_case(m, [8, 4, 3], {0: X}, None, lambda fd, x: fd.ops.select(x, -1, 1),
                                              lambda t: t.select(1, -1), []),
    "expand_sharded": lambda m: _unary_case(
        m, [8, 1], {0: X}, None, lambda fd, x: fd.ops.expand(x, [2, 8, 3]), lambda t: t.expand(2, 8, 3), []),
    "squeeze_expanded_sharded": lambda m: _unary_case(  # the expanded dim dropped: the broadcast without it
        m, [8, 1], {0: X}, None, lambda fd, x: fd.ops.squeeze(fd.ops.expand(x, [8, 3]), [1], squeeze_expanded=True),
        lambda t: t.squeeze(1), []),
    "logical_right_shift_sharded": lambda m: _unary_case(
        m, [8, 4], {0: X}, None, lambda fd, x: fd.ops.logical_right_shift(fd.ops.cast(fd.ops.mul(x, 1e3), DataType.Int),
                                                                           3),
        lambda t: ((t * 1e3).long() >> 3) & (2 ** 61 - 1), []),
    "welford_other_dim": lambda m: _unary_case(  # avg + var_sum / n
        m, [8, 4], {0: X}, None, lambda fd, x: (lambda a, s, n: fd.ops.add(a, fd.ops.div(s, n)))(*fd.ops.welford(x, 1)),
        lambda t: t.mean(1) + t.var(1, correction=0), []),
    "welford_sharded_dim": lambda m: _unary_case(  # the reduced dim gathered first
        m, [4, 8], {1: X}, None, lambda fd, x: fd.ops.div(*fd.ops.welford(x, 1)[1:]),
        lambda t: t.var(1, correction=0), ["allgather"]),
    "index_select_0d_index": lambda m: _indexed_case(
        m, [6, 8], {1: X}, torch.tensor(3), {}, lambda fd, x, i: fd.ops.index_select(x, i, 0),
        lambda a, i: a.index_select(0, i), []),
    # nvFuser's bias and mask follow a shard of the heads (a broadcast dim of theirs stays replicated) or of the
    # query's rows: locally sliced, no collective
    "sdpfa_bias_mask_heads_sharded": lambda m: attention_bias_mask_case(
        m, {1: X}, {1: X}, [2, 4, 8, 8], [2, 1, 8, 8]),
    "sdpfa_bias_mask_query_rows_sharded": lambda m: attention_bias_mask_case(
        m, {2: X}, {}, [1, 4, 8, 8], [2, 1, 8, 1]),
}
CASES_1D |= CASES_OPS


# --- 2x2 mesh cases (4 ranks) ----------------------------------------------------------------


def gathered_once_on_a_2d_mesh_case(mesh) -> Case:
    """``g @ w`` and ``permute(g) @ r`` with g's rows split on mesh_y (data parallel) and then mesh_x
    (sequence parallel): g is gathered on mesh_x once, and the permute reads that copy, still split on
    mesh_y (before: gathered twice). ``permute(g) @ r`` sums its batch rows over mesh_y."""
    t, h, f = 8, 8, 16
    with FusionDefinition() as fd:
        g, w, r = (fd.define_tensor(s, dtype=F64) for s in ([t, h], [h, f], [t, f]))
        p, q = fd.ops.matmul(g, w), fd.ops.matmul(fd.ops.permute(g, [1, 0]), r)
        fd.add_output(p)
        fd.add_output(q)
        shard(g, mesh)
        g.outer_split(0, 2).axis(0).parallelize(Y)
        g.outer_split(1, 2).axis(1).parallelize(X)
        shard(w, mesh, {1: X})
        shard(r, mesh, {0: Y, 1: X})
        shard(p, mesh, {0: Y, 1: X})
        shard(q, mesh, {1: X})
    full = [_rand(95, (t, h)), _rand(96, (h, f)), _rand(97, (t, f))]
    return Case(fd, [g, w, r], full, lambda g, w, r: [g @ w, g.T @ r], ["allgather", "allreduce"])


def lora_on_a_dp_sp_mesh_case(mesh) -> Case:
    """A LoRA adapter beside a column-parallel linear on a DP x SP mesh, ``linear(x, w) + linear(linear(x, a),
    b)`` with x's rows split on mesh_y (DP) and then mesh_x (SP), a replicated: the small GEMM ``linear(x, a)``
    runs on the copy of x gathered over mesh_x for ``linear(x, w)`` (still split over mesh_y), so x is
    gathered once (before: ``linear(x, a)`` ran on x's shards and its result was gathered too)."""
    t, h, f, r = 8, 8, 16, 4
    with FusionDefinition() as fd:
        x, w, a, b = (fd.define_tensor(s, dtype=F64) for s in ([t, h], [f, h], [r, h], [f, r]))
        y = fd.ops.add(fd.ops.linear(x, w), fd.ops.linear(fd.ops.linear(x, a), b))
        fd.add_output(y)
        shard(x, mesh)
        x.outer_split(0, 2).axis(0).parallelize(Y)
        x.outer_split(1, 2).axis(1).parallelize(X)
        for tv, dims in ((w, {0: X}), (a, {}), (b, {0: X}), (y, {0: Y, 1: X})):
            shard(tv, mesh, dims)
    full = [_rand(160 + i, shape) for i, shape in enumerate(([t, h], [f, h], [r, h], [f, r]))]
    return Case(fd, [x, w, a, b], full, lambda x, w, a, b: [x @ w.T + (x @ a.T) @ b.T], ["allgather"])


CASES_2D: dict[str, Callable[[DeviceMesh], Case]] = {
    "written_layer_norm_backward_of_a_pending_sum": lambda m: layer_norm_backward_of_a_pending_sum_case(
        m, False, written=True),
    "gathered_once_for_a_transpose": gathered_once_on_a_2d_mesh_case,
    "lora_on_a_dp_sp_mesh_gathers_x_once": lora_on_a_dp_sp_mesh_case,
    "dp_tp_mlp": lambda m: mlp_case(m, "dp_tp", shape=(4, 2, 8)),
    "dp_tp_mlp_f32": lambda m: mlp_case(m, "dp_tp", F32, shape=(4, 8)),
    "set_mesh_x_to_mesh_y_other_dim": lambda m: _unary_case(
        m, [4, 8], {0: X}, {1: Y}, lambda fd, x: fd.ops.set(x), lambda t: t, ["allgather"]),
    "set_two_axes_swap": lambda m: _unary_case(
        m, [4, 8], {0: X, 1: Y}, {1: X, 0: Y}, lambda fd, x: fd.ops.set(x), lambda t: t,
        ["allgather", "all_to_all"]),
    "set_two_axes_gather_all": lambda m: _unary_case(
        m, [4, 8], {0: X, 1: Y}, {}, lambda fd, x: fd.ops.set(x), lambda t: t, ["allgather", "allgather"]),
    "set_all_to_all_mesh_x": lambda m: _unary_case(
        m, [4, 8], {0: X}, {1: X}, lambda fd, x: fd.ops.set(x), lambda t: t, ["all_to_all"]),
    "topk_vocab_on_tp_two_stage": lambda m: _unary_case(  # one block per shard of the vocabulary (2), not per device
        m, [4, 64], {1: X}, None, lambda fd, x: _topk_sum(fd, x, 3, True), lambda t: _topk_sum_ref(t, 3, True),
        ["allgather", "allreduce"]),
    "sum_2d_allreduce_mesh_x": lambda m: _unary_case(
        m, [4, 8], {0: Y, 1: X}, None, lambda fd, x: fd.ops.sum(x, [1]), lambda t: t.sum(1), ["allreduce"]),
    "linear_2d_weight_sharded_n_and_k": lambda m: binary_case(
        m, [[4, 8], [6, 8]], [None, {0: Y, 1: X}], lambda fd, a, w: fd.ops.linear(a, w), F.linear,
        ["allreduce"]),
    "softmax_2d_reduces_over_one_axis": lambda m: _unary_case(  # each row's max and sum over mesh_x only
        m, [4, 8], {0: Y, 1: X}, None, lambda fd, x: fd.ops.softmax(x, 1), lambda t: torch.softmax(t, 1),
        ["allreduce", "allreduce"]),
    "replicated_plus_sharded_on_mesh_y": lambda m: binary_case(
        m, [[4, 8], [4, 8]], [{1: Y}, {}], lambda fd, a, b: fd.ops.mul(a, b), torch.mul, []),
    "permute_2d": lambda m: _unary_case(
        m, [4, 8, 2], {0: Y, 1: X}, None, lambda fd, x: fd.ops.permute(x, [2, 1, 0]),
        lambda t: t.permute(2, 1, 0), []),
    "same_dim_on_different_mesh_axes": lambda m: binary_case(
        m, [[8, 4], [8, 4]], [{0: X}, {0: Y}], lambda fd, a, b: fd.ops.add(a, b), torch.add, ["allgather"]),
    "mean_2d_both_axes": lambda m: _unary_case(  # one allreduce over both mesh axes together
        m, [4, 8], {0: Y, 1: X}, {}, lambda fd, x: fd.ops.mean(x, [0, 1], keepdim=True),
        lambda t: t.mean((0, 1), keepdim=True), ["allreduce"]),
    "sum_2d_both_axes": lambda m: _unary_case(
        m, [4, 8], {0: Y, 1: X}, None, lambda fd, x: fd.ops.sum(x, [0, 1]), lambda t: t.sum((0, 1)),
        ["allreduce"]),
}


# --- running on ranks ------------------------------------------------------------------------


def _check(case: Case, device: str = "cpu") -> None:
    fd = case.fd
    local = [shard_tensor(full, tv).to(device) for full, tv in zip(case.full, case.inputs)]
    saved = [t.clone() for t in local]
    outs = fd.execute(local)
    for i, (t, s) in enumerate(zip(local, saved)):
        assert torch.equal(t, s), f"input {i} was modified"
    expected = case.reference(*case.full)
    shardings = fd.output_shardings()
    assert len(outs) == len(expected) == len(shardings)
    input_storages = {t.untyped_storage().data_ptr() for t in local if t.numel()}
    for out, ref, sh in zip(outs, expected, shardings):
        assert not sh.has_partial
        torch.testing.assert_close(out.cpu(), shard_tensor(ref, sh), **(case.tolerance or {}))
        assert not out.numel() or out.untyped_storage().data_ptr() not in input_storages, "output aliases an input"
    # a mesh axis of size 1 never produces a collective: a world of 1 runs none
    assert fd.plan.collectives() == (case.collectives if dist.world_size() > 1 else []), str(fd.plan)
    plans = dist.gather_from_all(str(fd.plan))
    assert all(p == plans[0] for p in plans), "ranks printed different plans"


def _plan_cache(mesh: DeviceMesh) -> None:
    """A symbolic token count: a second execute with other sizes compiles a new plan without
    redefinition; the first sizes reuse their plan."""
    d = mesh.size
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([-1, 8], dtype=F64), fd.define_tensor([8, 8], dtype=F64)
        z = fd.ops.relu(fd.ops.linear(x, w))
        fd.add_output(z)
        shard(x, mesh, {0: X})
        shard(w, mesh)
        shard(z, mesh, {0: X})
    w_full = _rand(40, (8, 8))
    plans = []
    for tokens in (2 * d, 3 * d, 2 * d):
        x_full = _rand(41 + tokens, (tokens, 8))
        (out,) = fd.execute([shard_tensor(x_full, x), shard_tensor(w_full, w)])
        assert out.shape == (tokens // d, 8)
        torch.testing.assert_close(out, shard_tensor(torch.relu(F.linear(x_full, w_full)), fd.output_shardings()[0]))
        assert fd.plan.collectives() == []
        plans.append(fd.plan)
    assert plans[0] is not plans[1] and plans[2] is plans[0]
    assert "f64[?, 8]" not in str(plans[1]) and f"f64[{3 * d}, 8]" in str(plans[1])


def _bad_input_on_one_rank(mesh: DeviceMesh) -> None:
    """The last rank passes a wrongly shaped shard: every rank raises (none hangs), before any
    communication; the other ranks' errors name the rank that rejected its inputs."""
    d, rank = mesh.size, dist.rank()
    with FusionDefinition() as fd:
        x = fd.define_tensor([4 * d, 8], dtype=F64)
        z = fd.ops.sum(x, [0])
        fd.add_output(z)
        shard(x, mesh, {0: X})
    bad = d - 1
    local = torch.zeros(4 + (rank == bad), 8, dtype=torch.float64)
    try:
        fd.execute([local])
    except InputError as e:
        assert isinstance(e, ValueError)
        assert ("T0" in str(e) and "dim 0" in str(e)) if rank == bad else f"rank {bad}" in str(e), str(e)
    else:
        raise AssertionError("a wrongly shaped input on one rank was accepted")
    x_full = _rand(60, (4 * d, 8))
    (out,) = fd.execute([shard_tensor(x_full, x)])  # the ranks are still in step afterwards
    torch.testing.assert_close(out, x_full.sum(0))


def _mesh_larger_than_world(mesh: DeviceMesh) -> None:
    big = DeviceMesh(range(mesh.size + 1))
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 4], dtype=F64)
        fd.add_output(fd.ops.neg(x))
        shard(x, big)
    try:
        fd.execute([torch.zeros(8, 4, dtype=torch.float64)])
    except ShardingError as e:
        assert f"rank {mesh.size}" in str(e), str(e)
    else:
        raise AssertionError("a mesh larger than the world was accepted")


SPECIAL = {"plan_cache": _plan_cache, "bad_input_on_one_rank": _bad_input_on_one_rank,
           "mesh_larger_than_world": _mesh_larger_than_world}


def move_case(world: int, dst_dims) -> Case:
    """A ``set`` from the first half of the ranks to the second half: the meshes have one shape, so
    the shards move with send_recv (placements kept), then reshard on the destination mesh."""
    a, b = DeviceMesh(range(world // 2)), DeviceMesh(range(world // 2, world))
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 4], dtype=F64)
        z = fd.ops.set(x)
        fd.add_output(z)
        shard(x, a, {0: X})
        shard(z, b, dst_dims)
    # on meshes of one device the all_to_all is a size-1 mesh axis: no collective
    expected = ["send_recv"] if dst_dims == {0: X} or world == 2 else ["send_recv", "all_to_all"]
    return Case(fd, [x], [_rand(70, (8, 4))], lambda t: [t], expected)


def stage_residual_case(world: int, swap: bool) -> Case:
    """A pipeline stage's residual add, ``add(set(x), h)``: x from the first half of the ranks, h made on the
    second half and read there by a linear. The add runs on the second half whichever operand comes first:
    x is sent once, not h sent back and the sum sent forward again."""
    a, b = DeviceMesh(range(world // 2)), DeviceMesh(range(world // 2, world))
    with FusionDefinition() as fd:
        x, hin, w = fd.define_tensor([8, 4], dtype=F64), fd.define_tensor([8, 4], dtype=F64), \
            fd.define_tensor([4, 4], dtype=F64)
        h, xs = fd.ops.set(hin), fd.ops.set(x)
        y = fd.ops.linear(fd.ops.add(h, xs) if swap else fd.ops.add(xs, h), w)
        fd.add_output(y)
        shard(x, a), shard(hin, a), shard(h, b), shard(w, b), shard(y, b)
    full = [_rand(72, (8, 4)), _rand(73, (8, 4)), _rand(74, (4, 4))]
    return Case(fd, [x, hin, w], full, lambda x, h, w: [(x + h) @ w.T], ["send_recv", "send_recv"])


def broadcast_case(world: int) -> Case:
    """Replicated on rank 0 alone, then sharded over every other rank: a broadcast from rank 0
    (meshes of other shapes) or a send_recv (one rank to one rank), then a local slice."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([6, 4], dtype=F64)
        z = fd.ops.set(x)
        fd.add_output(z)
        shard(x, DeviceMesh([0]))
        shard(z, DeviceMesh(range(1, world)), {0: X})
    expected = ["send_recv"] if world == 2 else ["broadcast"]
    return Case(fd, [x], [_rand(71, (6, 4))], lambda t: [t], expected)


def _reversed_mesh(world: int) -> DeviceMesh:
    """Every rank, listed out of increasing order: the pieces must land by mesh position, not rank."""
    return DeviceMesh(list(reversed(range(world))))


def gather_case(world: int, dim: int) -> Case:
    """Shards on a 1-D mesh gathered into one of its devices (not its first): only that device's share
    moves, with one gather (nvFuser's Gather), instead of an allgather and a broadcast."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([2 * world, 3 * world], dtype=F64)
        z = fd.ops.set(x)
        fd.add_output(z)
        shard(x, _reversed_mesh(world), {dim: X})
        shard(z, DeviceMesh([world // 2]))
    return Case(fd, [x], [_rand(72, (2 * world, 3 * world))], lambda t: [t], ["gather"])


def reduce_case(world: int) -> Case:
    """A row-parallel linear's partial sums reduced into one device (nvFuser's Reduce)."""
    mesh = _reversed_mesh(world)
    with FusionDefinition() as fd:
        x = fd.define_tensor([6, 4 * world], dtype=F64)
        w = fd.define_tensor([5, 4 * world], dtype=F64)
        y = fd.ops.linear(x, w)
        z = fd.ops.set(y)
        fd.add_output(z)
        shard(x, mesh, {1: X})
        shard(w, mesh, {1: X})
        y.set_device_mesh(mesh)
        y.outer_split(-1, world)  # r{K} on mesh_x: a pending sum
        y.axis(-2).parallelize(X)
        shard(z, DeviceMesh([world - 1]))
    full = [_rand(73, (6, 4 * world)), _rand(74, (5, 4 * world))]
    return Case(fd, [x, w], full, lambda a, b: [F.linear(a, b)], ["reduce"])


def scatter_case(world: int) -> Case:
    """One device's value scattered in shards over a 1-D mesh that holds it (nvFuser's Scatter)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([3, 2 * world], dtype=F64)
        z = fd.ops.set(x)
        fd.add_output(z)
        shard(x, DeviceMesh([world - 1]))
        shard(z, _reversed_mesh(world), {1: X})
    return Case(fd, [x], [_rand(75, (3, 2 * world))], lambda t: [t], ["scatter"])


def kept_on_own_device_case(world: int) -> Case:
    """A replicated value moved to one of its own devices: that device holds it already, so nothing
    moves (a broadcast before)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([3, 4], dtype=F64)
        z = fd.ops.set(x)
        fd.add_output(fd.ops.mul(z, 2.0))
        shard(x, _reversed_mesh(world))
        shard(z, DeviceMesh([world - 1]))
    return Case(fd, [x], [_rand(76, (3, 4))], lambda t: [t * 2], [])


def onto_own_devices_case(world: int, held: str) -> Case:
    """A ``set`` onto some of the source mesh's own devices, in another order (world 2: [1, 0]; world 4:
    [1, 0] of [0, 1, 2, 3]). A replicated value is sliced where it is, a pending sum is summed on its
    mesh and kept: nothing moves between the meshes (a send_recv or a broadcast before). Shards move
    by send_recv between meshes of one shape, else are gathered on their mesh and sliced (not gathered
    and then broadcast); shards set whole are gathered on their mesh and kept (a send_recv before)."""
    src, dst = DeviceMesh(range(world)), DeviceMesh([1, 0])
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 4 * world], dtype=F64)
        w = fd.define_tensor([4, 4 * world], dtype=F64)
        y = fd.ops.linear(x, w)  # partial: a pending sum over the sharded in features
        z = fd.ops.set(y)
        fd.add_output(fd.ops.exp(z))
        shard(x, src, {1: X} if held == "partial" else {0: X} if held.startswith("shards") else {})
        shard(w, src, {1: X} if held == "partial" else {})
        shard(z, dst, {} if held in ("partial", "shards_whole") else {0: X})
    expected = {"replicated": [], "partial": ["allreduce"], "shards_whole": ["allgather"],
                "shards": ["send_recv"] if world == 2 else ["allgather"]}[held]
    full = [_rand(81, (8, 4 * world)), _rand(82, (4, 4 * world))]
    return Case(fd, [x, w], full, lambda a, b: [F.linear(a, b).exp()], expected)


def pending_sum_onto_own_devices_case(world: int, where: str) -> Case:
    """A row-parallel linear's pending sum y set twice: whole on its mesh and on rows of [1, 0] (reordered),
    or whole on device 0 and on columns of its mesh. The set onto its own devices reads the whole sum
    too, so y is summed whole once, then kept and sliced (two reductions before)."""
    mesh = DeviceMesh(range(world))
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([8, 4 * world], dtype=F64), fd.define_tensor([4 * world, 4 * world], dtype=F64)
        y = fd.ops.linear(x, w)
        a, b = fd.ops.set(y), fd.ops.set(y)
        fd.add_output(a)
        fd.add_output(b)
        shard(x, mesh, {1: X})
        shard(w, mesh, {1: X})
        if where == "reordered":
            shard(a, mesh)
            shard(b, DeviceMesh([1, 0]), {0: X})
        else:
            shard(a, DeviceMesh([0]))
            shard(b, mesh, {1: X})
    full = [_rand(83, (8, 4 * world)), _rand(84, (4 * world, 4 * world))]
    return Case(fd, [x, w], full, lambda p, q: [F.linear(p, q)] * 2, ["allreduce"])


def shards_kept_on_a_2d_mesh_case(world: int) -> Case:
    """Shards of a 1-D mesh set onto a [world, 1] mesh of the same devices, sharded on its first axis:
    every device holds its piece already, so nothing moves (an allgather and a broadcast before)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([2 * world, 3], dtype=F64)
        z = fd.ops.set(x)
        fd.add_output(fd.ops.neg(z))
        shard(x, _reversed_mesh(world), {0: X})
        shard(z, DeviceMesh(torch.tensor(_reversed_mesh(world).devices).reshape(world, 1)), {0: Y})
    return Case(fd, [x], [_rand(80, (2 * world, 3))], lambda t: [-t], [])


def reduced_into_one_device_case(world: int, body: str) -> Case:
    """An op on a 1-D mesh's shards whose smaller result goes to one of its devices runs on the whole
    mesh, and only its result moves: a sum over the sharded dim or a row-parallel linear (with a bias
    added once, on the device) with one ``reduce``, a sum over another dim with one ``gather``. (Before,
    the operands were gathered into the device and the op ran there alone.)"""
    mesh = _reversed_mesh(world)
    with FusionDefinition() as fd:
        x = fd.define_tensor([6, 4 * world], dtype=F64)
        if body == "sum_sharded_dim":
            z = fd.ops.sum(x, [1])
            args, ref, expected = [x], lambda a: [a.sum(1)], ["reduce"]
        elif body == "sum_other_dim":
            z = fd.ops.sum(x, [0])
            args, ref, expected = [x], lambda a: [a.sum(0)], ["gather"]
        else:
            w, b = fd.define_tensor([5, 4 * world], dtype=F64), fd.define_tensor([5], dtype=F64)
            z = fd.ops.linear(x, w, b)
            args, ref, expected = [x, w, b], lambda a, m, c: [F.linear(a, m, c)], ["reduce"]
            shard(w, mesh, {1: X})
            shard(b, mesh)
        fd.add_output(z)
        shard(x, mesh, {1: X})
        shard(z, DeviceMesh([world // 2]))
    full = [_rand(77 + i, fd.fusion.tensor(tv.name).shape) for i, tv in enumerate(args)]
    return Case(fd, args, full, ref, expected)


def row_parallel_linear_of_one_row_case(world: int) -> Case:
    """A row-parallel linear of one row on every rank but rank 0: its rows do not split over the ranks,
    so the fused segment runs sequentially, and rank 0, outside the mesh, prints the same plan (it
    printed "fused")."""
    mesh = DeviceMesh(range(1, world))
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([1, 6 * world], dtype=F64), fd.define_tensor([8, 6 * world], dtype=F64)
        y = fd.ops.linear(x, w)
        fd.add_output(y)
        shard(x, mesh, {1: X})
        shard(w, mesh, {1: X})
        shard(y, mesh)
    full = [_rand(83, (1, 6 * world)), _rand(84, (8, 6 * world))]
    return Case(fd, [x, w], full, lambda a, b: [F.linear(a, b)], ["allreduce"] if world > 2 else [])


def read_on_other_meshes_case(world: int, source: str) -> Case:
    """A tensor on the first half of the ranks read by two ops on the second half (``exp`` whole, ``neg`` on
    rows): it leaves its mesh once, for both (before: once per reader). ``source``: x sharded on rows (its
    shards sent to the other mesh, where ``exp``'s copy is gathered from them), or a row-parallel linear's
    pending sum that ``sin`` reads on its own mesh (one allreduce, then sent). At world 2 the meshes hold
    one device each: one send_recv, though the readers' targets differ on their mesh's size-1 axis."""
    a, b = DeviceMesh(range(world // 2)), DeviceMesh(range(world // 2, world))
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([8, 4], dtype=F64), fd.define_tensor([6, 4], dtype=F64)
        y = fd.ops.linear(x, w) if source == "partial" else x
        outs = [fd.ops.exp(y), fd.ops.neg(y)] + ([fd.ops.sin(y)] if source == "partial" else [])
        for o in outs:
            fd.add_output(o)
        shard(x, a, {1 if source == "partial" else 0: X})
        shard(w, a, {1: X} if source == "partial" else None)
        shard(outs[0], b)
        shard(outs[1], b, {0: X})
        if source == "partial":
            shard(outs[2], a)

    def reference(x, w):
        y = F.linear(x, w) if source == "partial" else x
        return [y.exp(), -y] + ([y.sin()] if source == "partial" else [])
    if world == 2:  # one device per mesh: nothing to gather or sum
        expected = ["send_recv"]
    else:
        expected = ["allreduce", "send_recv"] if source == "partial" else ["send_recv", "allgather"]
    return Case(fd, [x, w], [_rand(71, (8, 4)), _rand(72, (6, 4))], reference, expected)


def pending_sum_to_next_stage_case(world: int) -> Case:
    """A row-parallel linear's pending sum on the first half of the ranks, read whole on the second half (the
    next pipeline stage): reduce-scattered, its pieces sent, gathered there (Megatron's scatter-gather: P/2
    three times at world 4, where an allreduce and a send of the whole sent 2P)."""
    a, b = DeviceMesh(range(world // 2)), DeviceMesh(range(world // 2, world))
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([8, 4], dtype=F64), fd.define_tensor([6, 4], dtype=F64)
        z = fd.ops.tanh(fd.ops.set(fd.ops.linear(x, w)))
        fd.add_output(z)
        shard(x, a, {1: X})
        shard(w, a, {1: X})
        shard(z, b)
    expected = ["send_recv"] if world == 2 else ["reduce_scatter", "send_recv", "allgather"]
    return Case(fd, [x, w], [_rand(73, (8, 4)), _rand(74, (6, 4))], lambda x, w: [torch.tanh(F.linear(x, w))],
                expected)


def vocab_parallel_lookup_on_a_stage_case(world: int, how: str) -> Case:
    """A vocabulary-parallel lookup (embedding, index_select) on the first pipeline stage: the ranks of the other
    stage, outside the table's mesh, build their plan too (they failed to: the rows they hold were asked of a
    mesh without them). Each rank of the stage looks up the rows it holds; one allreduce sums them."""
    stage = DeviceMesh(range(world // 2))
    with FusionDefinition() as fd:
        w, idx = fd.define_tensor([8, 4], dtype=F64), fd.define_tensor([6], dtype=DataType.Int)
        y = fd.ops.embedding_fwd(idx, w) if how == "embedding" else fd.ops.index_select(w, idx, 0)
        fd.add_output(y)
        shard(w, stage, {0: X})
        shard(idx, stage)
        shard(y, stage)
    expected = [] if world == 2 else ["allreduce"]  # a stage of one device holds every row
    return Case(fd, [w, idx], [_rand(75, (8, 4)), torch.tensor([0, 7, 3, 4, 1, 6])],
                lambda w, i: [F.embedding(i, w)], expected)


CASES_MESHES = {  # world >= 2: two disjoint meshes, or a mesh and one of its devices
    "vocab_parallel_embedding_on_a_stage": lambda w: vocab_parallel_lookup_on_a_stage_case(w, "embedding"),
    "vocab_parallel_index_select_on_a_stage": lambda w: vocab_parallel_lookup_on_a_stage_case(w, "index_select"),
    "pending_sum_to_next_stage_scattered": pending_sum_to_next_stage_case,
    "shards_read_on_another_mesh_leave_once": lambda w: read_on_other_meshes_case(w, "shards"),
    "pending_sum_read_on_another_mesh_summed_once": lambda w: read_on_other_meshes_case(w, "partial"),
    "send_recv_between_meshes": lambda w: move_case(w, {0: X}),
    "send_recv_then_all_to_all": lambda w: move_case(w, {1: X}),
    "broadcast_to_other_mesh": broadcast_case,
    "stage_residual_add_runs_where_it_is_read": lambda w: stage_residual_case(w, False),
    "stage_residual_add_runs_where_it_is_read_swapped": lambda w: stage_residual_case(w, True),
    "gather_rows_into_one_device": lambda w: gather_case(w, 0),
    "gather_columns_into_one_device": lambda w: gather_case(w, 1),
    "reduce_into_one_device": reduce_case,
    "scatter_from_one_device": scatter_case,
    "replicated_kept_on_one_of_its_devices": kept_on_own_device_case,
    "shards_kept_on_a_2d_mesh_of_their_devices": shards_kept_on_a_2d_mesh_case,
    "row_parallel_linear_of_one_row_on_some_ranks": row_parallel_linear_of_one_row_case,
    "replicated_sliced_on_its_own_devices": lambda w: onto_own_devices_case(w, "replicated"),
    "pending_sum_kept_on_its_own_devices": lambda w: onto_own_devices_case(w, "partial"),
    "shards_onto_some_of_their_devices": lambda w: onto_own_devices_case(w, "shards"),
    "shards_whole_onto_some_of_their_devices": lambda w: onto_own_devices_case(w, "shards_whole"),
    "pending_sum_whole_and_on_its_devices_reordered": lambda w: pending_sum_onto_own_devices_case(w, "reordered"),
    "pending_sum_on_one_device_and_on_columns": lambda w: pending_sum_onto_own_devices_case(w, "one_device"),
    "sum_of_shards_into_one_device": lambda w: reduced_into_one_device_case(w, "sum_sharded_dim"),
    "sum_of_other_dim_into_one_device": lambda w: reduced_into_one_device_case(w, "sum_other_dim"),
    "row_parallel_linear_into_one_device": lambda w: reduced_into_one_device_case(w, "linear"),
}


# Cases run again on meshes that list their ranks out of increasing order: torch's process groups number
# the ranks increasingly, so the collectives reorder the pieces by mesh position; the fused GEMM kernels
# need rank order, so these plans run their collectives plain.
SHUFFLED_1D = ["sp_mlp", "tp_mlp", "linear_reduce_scatter_bias", "sp_linear_allgather", "set_all_to_all",
               "set_all_to_all_back"]
SHUFFLED_2D = ["dp_tp_mlp", "set_two_axes_swap", "set_mesh_x_to_mesh_y_other_dim"]


def shuffled_mesh(world: int) -> DeviceMesh:
    """Every rank, in an order that is neither increasing nor reversed where the world allows."""
    return DeviceMesh({1: [0], 2: [1, 0], 4: [2, 0, 3, 1]}[world])


def run_cases(rank: int, world: int, names_1d, names_2d, device="cpu", special=True,
              warned: dict[str, list[str]] | None = None) -> dict:
    """Run the cases on this rank; every rank gets {case: None or the failing ranks' tracebacks}.
    ``device`` is where the local shards live (CUDA with NCCL: tests/gpu/nccl_end_to_end.py). With
    ``warned``, each case's warnings are recorded there ({case: messages}) instead of shown."""
    torch.manual_seed(0)
    mesh1 = DeviceMesh(range(world))
    mesh2 = DeviceMesh(torch.arange(4).reshape(2, 2)) if world == 4 else None
    todo = [(n, lambda n=n: _check(CASES_1D[n](mesh1), device)) for n in names_1d]
    todo += [(n, lambda n=n: SPECIAL[n](mesh1)) for n in SPECIAL if special]
    todo += [(f"2x2/{n}", lambda n=n: _check(CASES_2D[n](mesh2), device)) for n in names_2d]
    if world >= 2:
        todo += [(n, lambda n=n: _check(CASES_MESHES[n](world), device)) for n in CASES_MESHES]
        todo += [(f"shuffled/{n}", lambda n=n: _check(CASES_1D[n](shuffled_mesh(world)), device)) for n in SHUFFLED_1D]
    if world == 4:
        todo += [(f"shuffled 2x2/{n}", lambda n=n: _check(CASES_2D[n](DeviceMesh([[3, 1], [0, 2]])), device))
                 for n in SHUFFLED_2D]
    results = {}
    for name, run in todo:
        try:
            with warnings.catch_warnings(record=warned is not None) as caught:
                if warned is not None:
                    warnings.simplefilter("always")
                run()
            if caught:
                warned[name] = [str(w.message) for w in caught]
            err = None
        except Exception:
            err = f"rank {rank}: {traceback.format_exc()}"
            print(f"case {name} failed on {err}", file=sys.stderr, flush=True)  # before a broken group hides it
        errs = [e for e in dist.gather_from_all(err) if e]  # also keeps the ranks in step
        results[name] = "\n".join(errs) if errs else None
    return results


# --- the tests: on the batched gloo ranks of each world size (the multidevice_test fixture) -------


@pytest.mark.parametrize("name", [*CASES_1D, *SPECIAL])
def test_case(multidevice_test, name):
    mesh = DeviceMesh(range(multidevice_test.size))
    if name in SPECIAL:
        SPECIAL[name](mesh)
    else:
        _check(CASES_1D[name](mesh))


@pytest.mark.ranks(2, 4)
@pytest.mark.parametrize("name", SHUFFLED_1D)
def test_case_on_a_shuffled_mesh(multidevice_test, name):
    _check(CASES_1D[name](shuffled_mesh(multidevice_test.size)))


@pytest.mark.ranks(4)
@pytest.mark.parametrize("name", SHUFFLED_2D)
def test_case_on_a_shuffled_2x2_mesh(multidevice_test, name):
    _check(CASES_2D[name](DeviceMesh([[3, 1], [0, 2]])))


@pytest.mark.ranks(4)
@pytest.mark.parametrize("name", list(CASES_2D))
def test_case_2x2(multidevice_test, name):
    _check(CASES_2D[name](DeviceMesh(torch.arange(4).reshape(2, 2))))


@pytest.mark.ranks(2, 4)
@pytest.mark.parametrize("name", list(CASES_MESHES))
def test_case_between_meshes(multidevice_test, name):
    _check(CASES_MESHES[name](multidevice_test.size))


def test_a_pending_sum_output_comes_back_in_its_layout(multidevice_test):
    """An output scheduled as a pending sum (a parallelized piece of its reduction axis) with a
    column-major allocation domain is summed and returned column-major (it came back row-major)."""
    n = multidevice_test.size
    mesh = DeviceMesh(range(n))
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([8, 4 * n], dtype=F64), fd.define_tensor([6, 4 * n], dtype=F64)
        y = fd.ops.linear(x, w)  # loop [8, 6, r{4n}]
        fd.add_output(y)
        shard(x, mesh, {1: X})
        shard(w, mesh, {1: X})
        y.set_device_mesh(mesh)
        y.outer_split(-1, n)
        y.axis(-2).parallelize(X)  # [8, 6, rmesh_x{n}, r{4}]
        y.set_allocation_domain([y.axis(2), y.axis(3), y.axis(1), y.axis(0)], True)
    full = [_rand(101, (8, 4 * n)), _rand(102, (6, 4 * n))]
    (out,) = fd.execute([shard_tensor(t, tv) for t, tv in zip(full, (x, w))])
    torch.testing.assert_close(out, F.linear(*full))
    assert out.stride() == (1, 8)


def test_run_on_ranks_reports_failures():
    with pytest.raises(RuntimeError, match="ranks failed"):
        run_on_ranks(_fail_on_rank_1, 2, timeout_s=30)


def test_run_on_ranks_unguarded_in_a_script_says_what_to_do(tmp_path):
    """Each spawned rank imports the script again; called at import, run_on_ranks fails on every rank
    before the function runs: the error says to guard the call."""
    script = tmp_path / "unguarded.py"
    script.write_text("from tp_fusion.launch import run_on_ranks\n\n\ndef f(rank, world):\n    pass\n\n\n"
                      "run_on_ranks(f, 2, timeout_s=30)\n")
    proc = run_python(str(script), timeout=120)
    assert proc.returncode != 0
    assert 'must call it under `if __name__ == "__main__":`' in proc.stderr.splitlines()[-1]


def _fail_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("deliberate")


@pytest.mark.ranks(2, 4)
@pytest.mark.parametrize("first", ["uniform", "normal", "sdpfa_dropout"])
def test_unseeded_draws_stay_alike_on_every_rank(multidevice_test, first):
    """An unseeded draw on a mesh of rank 0 only, then one replicated on every rank: the second must be
    the same on every rank (each rank takes one seed per unseeded draw, running it or not)."""
    world = multidevice_test.size
    with FusionDefinition() as fa:
        x = fa.define_tensor([1, 1, 4, 8], dtype=F64)
        if first == "sdpfa_dropout":
            y = fa.ops.sdpfa_fwd(x, x, x, dropout_p=0.5)[0]
        else:
            y = fa.ops.add(x, getattr(fa.ops, first)(0.0, 1.0, [1, 1, 4, 8], dtype=F64))
        fa.add_output(y)
        x.set_device_mesh(DeviceMesh([0]))
    with FusionDefinition() as fb:
        z = fb.define_tensor([4], dtype=F64)
        o = fb.ops.add(z, fb.ops.normal(0.0, 1.0, [4], dtype=F64))
        fb.add_output(o)
        for tv in (z, o):
            tv.set_device_mesh(DeviceMesh(range(world)))
    full = _rand(90, (1, 1, 4, 8))
    fa.execute([shard_tensor(full, x)])
    (out,) = fb.execute([torch.zeros(4, dtype=torch.float64)])
    everyone = dist.gather_from_all(out)
    assert all(torch.equal(o, everyone[0]) for o in everyone), everyone
