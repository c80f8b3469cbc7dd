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
