"""Scalar inputs on one GPU: the numbers ``execute`` takes become 0-d tensors on the inputs' device (an
operand read at every call), value attributes (a seed, a fill value) are read at every call, and attributes
that shape the plan build a plan per value.

Run on a machine with a GPU:  python -m pytest tests/gpu/test_scalar_inputs_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from tp_fusion import DataType, FusionDefinition

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_scalar_inputs_on_cuda():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=DataType.BFloat16)
        rows = fd.define_scalar(None, dtype=DataType.Int)
        scale = fd.define_scalar(None, dtype=DataType.Double)
        y = fd.ops.mul(fd.ops.reshape(x, [rows, -1]), scale)
        fd.add_output(fd.ops.sum(fd.ops.cast(y, DataType.Float), [1]))
    x_full = torch.randn(8, 6, device="cuda", dtype=torch.bfloat16)
    for r, s in ((4, 0.5), (4, 3.0), (2, 0.5), (4, -1.0)):
        (out,) = fd.execute([x_full, r, s])
        ref = (x_full.reshape(r, -1) * s).float().sum(1)
        assert out.device == x_full.device and out.dtype == torch.float32
        torch.testing.assert_close(out, ref)
    assert len(fd._executor._cache) == 2  # one plan per value of rows; scale is read at every call


def _noisy(seed, bias) -> FusionDefinition:
    """x + normal draw of ``seed`` + a tensor filled with ``bias``: numbers, or scalar inputs where None."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([16, 32], dtype=DataType.BFloat16)
        seed = fd.define_scalar(None, dtype=DataType.Int) if seed is None else seed
        bias = fd.define_scalar(None, dtype=DataType.Double) if bias is None else bias
        noise = fd.ops.normal(0.0, 1.0, [16, 32], dtype=DataType.BFloat16, rng_seed=seed, rng_offset=0)
        fd.add_output(fd.ops.add(fd.ops.add(x, noise), fd.ops.full([16, 32], bias, DataType.BFloat16)))
    return fd


def test_a_seed_and_a_fill_value_from_scalars_are_read_at_every_call_on_cuda():
    """A draw on the GPU seeded by a scalar input follows each call's seed (the draw of the numbers written in),
    and a fill value from a scalar too, with one plan for every value."""
    fd = _noisy(None, None)
    x_full = torch.randn(16, 32, device="cuda", dtype=torch.bfloat16)
    outs = []
    for s, b in ((1, 0.5), (2, 0.5), (1, -2.0)):
        (out,) = fd.execute([x_full, s, b])
        (expected,) = _noisy(s, b).execute([x_full])
        assert out.device == x_full.device
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        outs.append(out)
    assert not torch.equal(outs[0], outs[1])
    assert len(fd._executor._cache) == 1
