"""Regions: the elementwise runs of compute segments that the runner hands to torch.compile
(tp_fusion/runtime/regions.py). ``TP_FUSION_COMPILE=eager`` traces them with dynamo without
generating code, so CI checks the cut into regions, their inputs and outputs, and the values
(``TP_FUSION_COMPILE=1`` ran examples/transformer_layer.py and tests/gpu on 2x H200)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tp_fusion import DataType, FusionDefinition
from tp_fusion.runtime import regions


def _layer(fd, x, w, b, g):
    """A decomposed layer norm (eight elementwise ops), a linear, then an erf-GELU (a tanh-GELU would join
    the GEMM's epilogue) and a residual add."""
    var, mean = fd.ops.var_mean(x, [1], correction=0, keepdim=True)
    xhat = fd.ops.mul(fd.ops.sub(x, mean), fd.ops.rsqrt(fd.ops.add(var, 1e-5)))
    y = fd.ops.add(fd.ops.mul(xhat, g), 0.5)
    h = fd.ops.linear(y, w, b)
    return fd.ops.add(fd.ops.gelu(h, approximate="none"), x), mean


def _fusion():
    with FusionDefinition() as fd:
        x, w, b, g = (fd.define_tensor(s, dtype=DataType.Double) for s in ([6, 8], [8, 8], [8], [8]))
        out, mean = _layer(fd, x, w, b, g)
        fd.add_output(out)
        fd.add_output(mean)  # read after its region: a region output
    return fd


def _inputs():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=gen, dtype=torch.float64) for s in ([6, 8], [8, 8], [8], [8])]


def _reference(x, w, b, g):
    var, mean = torch.var_mean(x, 1, correction=0, keepdim=True)
    y = (x - mean) * torch.rsqrt(var + 1e-5) * g + 0.5
    return F.gelu(F.linear(y, w, b), approximate="none") + x, mean


def test_regions_match_op_by_op(monkeypatch):
    built = []
    real = regions.region

    def spy(steps, read_later, how):
        built.append([s.op.kind for s in steps])
        return real(steps, read_later, how)
    monkeypatch.setattr(regions, "region", spy)
    monkeypatch.setenv("TP_FUSION_COMPILE", "eager")
    fd, inputs = _fusion(), _inputs()
    got = fd.execute(inputs)
    # The layer norm's ops form one region, the GELU and the add another; the linear stays between
    # (every runner built, tuning's included, cuts the program alike).
    assert {tuple(kinds) for kinds in built} == {("var_mean", "sub", "add", "rsqrt", "mul", "mul", "add"),
                                                 ("gelu", "add")}, built
    for a, b in zip(got, _reference(*inputs)):
        torch.testing.assert_close(a, b)
    monkeypatch.setenv("TP_FUSION_COMPILE", "0")
    for a, b in zip(_fusion().execute(inputs), got):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("setting,want", [("0", ""), ("1", "inductor"), ("eager", "eager"), (None, "")])
def test_mode(monkeypatch, setting, want):
    if setting is None:
        monkeypatch.delenv("TP_FUSION_COMPILE", raising=False)
    else:
        monkeypatch.setenv("TP_FUSION_COMPILE", setting)
    assert regions.mode() == want


def test_split_keeps_short_runs_op_by_op():
    flags = [True, False, True, True, False, True]
    runs = regions.split(tuple(range(6)), lambda i: flags[i])
    assert runs == [(False, [0, 1]), (True, [2, 3]), (False, [4, 5])]
