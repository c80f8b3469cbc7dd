"""Same inputs give bitwise-identical outputs across runs on the CPU (single process; the
multi-rank counterpart runs inside tests/multidevice/test_properties.py, ``repeat``)."""

from __future__ import annotations

import torch

from tp_fusion import DataType, FusionDefinition


def _define():
    with FusionDefinition() as fd:
        x = fd.define_tensor([16, 32], dtype=DataType.Float)
        w = fd.define_tensor([24, 32], dtype=DataType.Float)
        b = fd.define_tensor([24], dtype=DataType.Float)
        y = fd.ops.gelu(fd.ops.linear(x, w, b), approximate="tanh")
        s = fd.ops.softmax(fd.ops.layer_norm(y, [24]), 1)
        m = fd.ops.mean(fd.ops.matmul(s, fd.ops.permute(y, [1, 0])), [0])
        fd.add_output(s)
        fd.add_output(m)
        fd.add_output(fd.ops.sum(y, [0, 1]))
    return fd


def _inputs():
    g = torch.Generator().manual_seed(7)
    return [torch.randn(16, 32, generator=g), torch.randn(24, 32, generator=g), torch.randn(24, generator=g)]


def test_outputs_are_bitwise_identical_across_runs():
    fd = _define()
    first = fd.execute(_inputs())
    again = fd.execute(_inputs())  # the cached plan
    rebuilt = _define().execute(_inputs())  # a new definition and plan
    for a, b, c in zip(first, again, rebuilt, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_inputs_are_not_modified():
    fd = _define()
    inputs = _inputs()
    before = [x.clone() for x in inputs]
    fd.execute(inputs)
    assert all(torch.equal(x, y) for x, y in zip(inputs, before, strict=True))
