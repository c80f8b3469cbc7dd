"""Scalar inputs on one GPU: the numbers ``execute`` takes become 0-d tensors on the inputs' device (an
operand read at every call), and bound attributes build a plan per value.

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
