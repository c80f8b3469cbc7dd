"""What the runner keeps in memory while it runs a plan (tp_fusion/runtime/runner.py): an intermediate is
released once its last reader has run, as torch releases a tensor nothing refers to any more, rather than
held to the end of the call (a chain of N full-size intermediates needed N times the memory; nvFuser's
audit tests of a few GiB of inputs ran out of memory)."""

from __future__ import annotations

import dataclasses
import weakref

import torch

from tp_fusion import DataType, FusionDefinition
from tp_fusion import ops as _ops


def _spy(monkeypatch, kind: str, before=None, after=None) -> None:
    """Run ``before(operands)`` before and ``after(result)`` after op ``kind``'s implementation."""
    original = _ops.OPS[kind]

    def impl(*args, **kw):
        if before is not None:
            before(args)
        out = original.impl(*args, **kw)
        if after is not None:
            after(out)
        return out
    monkeypatch.setitem(_ops.OPS, kind, dataclasses.replace(original, impl=impl))


def test_an_intermediate_is_released_after_its_last_reader(monkeypatch):
    with FusionDefinition() as fd:
        x = fd.define_tensor([64, 32], dtype=DataType.Double)
        a = fd.ops.exp(x)  # read by neg and by mul: alive until the mul
        b = fd.ops.neg(a)  # read by sin only
        c = fd.ops.sin(b)
        d = fd.ops.mul(c, a)
        fd.add_output(fd.ops.tanh(d))
        fd.add_output(b)  # an output: kept to the end whatever reads it
    made, alive_at = {}, {}

    def keep(name):
        return lambda out: made.__setitem__(name, weakref.ref(out))

    def record(kind):
        return lambda args: alive_at.__setitem__(kind, {k: r() is not None for k, r in made.items()})
    _spy(monkeypatch, "exp", after=keep("a"))
    _spy(monkeypatch, "sin", after=keep("c"))
    _spy(monkeypatch, "mul", before=record("mul"), after=keep("d"))
    _spy(monkeypatch, "tanh", before=record("tanh"))
    x_in = torch.randn(64, 32, dtype=torch.float64)
    out, b_out = fd.execute([x_in])
    a_ref = torch.exp(x_in)
    torch.testing.assert_close(out, torch.tanh(torch.sin(-a_ref) * a_ref))
    torch.testing.assert_close(b_out, -a_ref)
    # The mul reads a and c; by the tanh both are released (d, the tanh's operand, is still alive).
    assert alive_at["mul"] == {"a": True, "c": True}, alive_at
    assert alive_at["tanh"] == {"a": False, "c": False, "d": True}, alive_at


def test_a_pointwise_op_of_broadcasts_runs_once_per_broadcast_element(monkeypatch):
    """A pointwise op whose operands are all broadcast along a dim (an expanded broadcast_in_dim) computes that
    dim once and expands the result, as nvFuser keeps the dim a broadcast: aten would write every element (a
    reciprocal of a row statistic expanded over a row, or a cast of an expanded mask, each a full tensor)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([6, 1], dtype=DataType.Double)
        y = fd.define_tensor([6, 500], dtype=DataType.Double)
        m = fd.define_tensor([4, 5], dtype=DataType.BFloat16)
        z = fd.define_tensor([1, 3, 4, 4], dtype=DataType.Float)
        bx = fd.ops.broadcast_in_dim(x, shape=[6, 500], broadcast_dims=[0, 1])
        fd.add_output(fd.ops.mul(y, fd.ops.reciprocal(bx)))
        fd.add_output(fd.ops.add(bx, fd.ops.neg(bx)))  # both operands broadcast: the output itself
        bm = fd.ops.broadcast_in_dim(fd.ops.slice(m, [0, 0], [4, 4]), shape=[1, 3, 4, 4], broadcast_dims=[2, 3])
        fd.add_output(fd.ops.add(fd.ops.cast(bm, DataType.Float), z))
    seen = {}
    for kind in ("reciprocal", "neg", "cast", "add"):
        _spy(monkeypatch, kind, before=lambda args, kind=kind: seen.setdefault(kind, []).append(
            [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]))
    gen = torch.Generator().manual_seed(0)
    xs, ys = (torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in ((6, 1), (6, 500)))
    ms, zs = torch.randn(4, 5, generator=gen).bfloat16(), torch.randn(1, 3, 4, 4, generator=gen)
    got = fd.execute([xs, ys, ms, zs])
    want = [ys * torch.reciprocal(xs.expand(6, 500)), xs.expand(6, 500) - xs.expand(6, 500),
            ms[:, :4].expand(1, 3, 4, 4).float() + zs]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
        assert g.is_contiguous()  # outputs come back laid out as before (row-major), whatever the runner kept
    assert seen["reciprocal"] == [[(6, 1)]] and seen["neg"] == [[(6, 1)]], seen
    assert seen["cast"] == [[(1, 1, 4, 4)]], seen  # the expanded dim of 3 is cast once
    assert sorted(seen["add"]) == [[(1, 3, 4, 4), (1, 3, 4, 4)], [(6, 1), (6, 1)]], seen


def test_only_pointwise_steps_of_possible_broadcasts_check_strides():
    """The stride check costs host time on every call, so the runner runs it only for pointwise steps whose
    operands may all be broadcasts along some dim (``runner._on_broadcasts``): here the reciprocal of an
    expanded column and the sum of two expanded operands, not the products of a full tensor with them."""
    from tp_fusion.runtime.runner import _on_broadcasts

    with FusionDefinition() as fd:
        x = fd.define_tensor([6, 1], dtype=DataType.Double)
        y = fd.define_tensor([6, 500], dtype=DataType.Double)
        bx = fd.ops.broadcast_in_dim(x, shape=[6, 500], broadcast_dims=[0, 1])
        r = fd.ops.reciprocal(bx)
        both = fd.ops.add(r, bx)
        fd.add_output(fd.ops.tanh(fd.ops.mul(y, both)))
    plan = fd.compile([[6, 1], [6, 500]])
    assert _on_broadcasts(plan) == {r.name, both.name}
