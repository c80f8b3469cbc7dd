"""Issue 12 (reliability), the single-process parts: clear tp_fusion errors at definition for
mixed dtypes, integer negative powers, bad meshes and bad arguments; one execute at a time per
process; execute is forward only (inputs that require grad, outputs that do not)."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch

from tp_fusion import (
    DataType,
    DefinitionError,
    DeviceMesh,
    ExecutionError,
    FusionDefinition,
    ShardingError,
    TPFusionError,
)
from tp_fusion import ops as _ops


def _define(fn):
    with FusionDefinition() as fd:
        return fn(fd)


@pytest.mark.parametrize("make", [
    lambda fd: fd.ops.linear(fd.define_tensor([2, 3], dtype=DataType.Double), fd.define_tensor([4, 3])),
    lambda fd: fd.ops.matmul(fd.define_tensor([2, 3], dtype=DataType.BFloat16), fd.define_tensor([3, 4])),
    lambda fd: fd.ops.layer_norm(fd.define_tensor([2, 3], dtype=DataType.Double), [3], fd.define_tensor([3])),
], ids=["linear_f64_f32", "matmul_bf16_f32", "layer_norm_f64_f32"])
def test_mixed_dtypes_rejected_at_definition(make):
    with pytest.raises(DefinitionError, match="different dtypes.*cast them first"):
        _define(make)


def test_int_pow_negative_rejected_like_torch():
    with pytest.raises(RuntimeError):  # torch itself
        torch.pow(torch.arange(1, 5), -1)
    with pytest.raises(DefinitionError, match="negative integer power"):
        _define(lambda fd: fd.ops.pow(fd.define_tensor([4], dtype=DataType.Int), -1))
    # A float base or a non-negative power stays valid.
    _define(lambda fd: fd.ops.pow(fd.define_tensor([4], dtype=DataType.Int), 2))
    _define(lambda fd: fd.ops.pow(fd.define_tensor([4]), -1))


@pytest.mark.parametrize("make", [
    lambda fd, m: fd.ops.abs(m), lambda fd, m: fd.ops.relu(m), lambda fd, m: fd.ops.sub(m, 1),
    lambda fd, m: fd.ops.sub(1.5, m), lambda fd, m: fd.ops.neg(m), lambda fd, m: fd.ops.gelu(m),
], ids=["abs", "relu", "sub_number", "rsub_number", "neg", "gelu"])
def test_bool_operands_torch_rejects_are_rejected_at_definition(make):
    """What torch's kernels refuse for bool (checked there, not in its meta functions) fails when the
    op is recorded, not inside execute after the communication has started."""
    with pytest.raises(DefinitionError, match="torch rejects operands"):
        _define(lambda fd: make(fd, fd.define_tensor([3, 4], dtype=DataType.Bool)))


@pytest.mark.parametrize("devices,match", [
    ([[0, 1], [2]], "rectangular"),
    ([[0, 1], 2], "rectangular"),
    ([0.7, 1.2], "0.7 is not an integer rank"),
    ("01", "a string is not a list of ranks"),
    ([True, False], "not an integer rank"),
    (torch.tensor([0.0, 1.0]), "must be integers"),
    (5, "expected an iterable of ranks"),
    ([], "at least one device"),
    ([0, 0], "repeats device"),
])
def test_bad_device_mesh(devices, match):
    with pytest.raises(ShardingError, match=match) as info:
        DeviceMesh(devices)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("devices,shape", [
    (range(4), (4,)), ((0, 1), (2,)), ([[0, 1], [2, 3]], (2, 2)), (torch.arange(4).reshape(2, 2), (2, 2)),
    (np.arange(8).reshape(2, 2, 2), (2, 2, 2)), ([np.int64(1), np.int64(0)], (2,)),
])
def test_good_device_mesh(devices, shape):
    mesh = DeviceMesh(devices)
    assert mesh.shape == shape and all(type(d) is int for d in mesh.devices)


@pytest.mark.parametrize("make,cls,match", [
    (lambda fd: fd.define_tensor([True, 4]), DefinitionError, r"define_tensor: shape \[True, 4\]"),
    (lambda fd: fd.ops.unsqueeze(fd.define_tensor([2, 3]), "1"), DefinitionError, "unsqueeze: dim '1'"),
    (lambda fd: fd.ops.full([2, 3], 1.0, torch.float32), DefinitionError, "dtype must be a DataType"),
    (lambda fd: fd.ops.conv2d, AttributeError, "no op 'conv2d'; the ops are: .*linear.*relu"),
    # a TensorView where a list belongs; a dim that is no int; a keepdim that is no bool (was taken as True)
    (lambda fd: fd.ops.cat(fd.define_tensor([2, 3]), 0), DefinitionError, "cat: pass a list of tensors, got a "),
    (lambda fd: fd.ops.mean(fd.define_tensor([2, 3]), [1.0]), DefinitionError,
     r"mean: dims must be an int or a list of ints"),
    (lambda fd: fd.ops.sum(fd.define_tensor([2, 3]), [1], keepdim="no"), DefinitionError,
     "sum: keepdim must be True or False, got 'no'"),
    (lambda fd: fd.ops.var_mean(fd.define_tensor([2, 3]), [1], keepdim=1), DefinitionError,
     "var_mean: keepdim must be True or False, got 1"),
    # shapes and arguments torch refuses at once (they failed inside execute, or were taken)
    (lambda fd: fd.ops.reshape(fd.define_tensor([2, 3]), [-2, -3]), DefinitionError,
     r"reshape: shape \[-2, -3\] has a negative extent"),
    (lambda fd: fd.ops.broadcast_in_dim(fd.define_tensor([2, 3]), [-2, 2, 3], [1, 2]), DefinitionError,
     r"broadcast_in_dim: shape \[-2, 2, 3\] has a negative extent"),
    (lambda fd: fd.ops.expand(fd.define_tensor([1, 3]), [-2, 3]), DefinitionError,
     r"expand: shape \[-2, 3\] has a negative extent"),
    (lambda fd: fd.ops.layer_norm(fd.define_tensor([2, 3]), []), DefinitionError,
     "layer_norm: normalized_shape must have at least one extent"),
    (lambda fd: fd.ops.native_layer_norm(fd.define_tensor([2, 3]), [], None, None, 1e-5), DefinitionError,
     "native_layer_norm: normalized_shape must have at least one extent"),
    (lambda fd: fd.ops.permute(fd.define_tensor([2, 3]), [True, False]), DefinitionError,
     "permute: dims .* are not a permutation"),
    (lambda fd: fd.ops.uniform(1.0, 0.0, [2, 3]), DefinitionError, "uniform: low 1.0 is above high 0.0"),
    (lambda fd: fd.define_scalar(2**40, DataType.Int32), DefinitionError,
     "define_scalar: 1099511627776 does not fit in torch.int32"),
])
def test_bad_arguments_give_clear_errors(make, cls, match):
    with pytest.raises(cls, match=match) as info:
        _define(make)
    assert isinstance(info.value, TPFusionError), repr(info.value)


def test_execute_forward_only_single_process():
    with FusionDefinition() as fd:
        x = fd.define_tensor([3, 4])
        w = fd.define_tensor([5, 4])
        fd.add_output(fd.ops.relu(fd.ops.linear(x, w)))
    xv = torch.randn(3, 4).requires_grad_()
    wv = torch.nn.Parameter(torch.randn(5, 4))
    (out,) = fd.execute([xv, wv])
    assert not out.requires_grad and out.grad_fn is None
    torch.testing.assert_close(out, torch.relu(xv @ wv.T).detach())


def test_concurrent_execute_raises(monkeypatch):
    """A second thread's execute while one is running raises ExecutionError at once (no deadlock)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([2, 2])
        fd.add_output(fd.ops.relu(x))
    inside, release = threading.Event(), threading.Event()
    original = _ops.OPS["relu"]

    def slow(t, **kw):
        inside.set()
        assert release.wait(10)
        return original.impl(t, **kw)
    monkeypatch.setitem(_ops.OPS, "relu", dataclasses.replace(original, impl=slow))
    results = []
    thread = threading.Thread(target=lambda: results.append(fd.execute([torch.ones(2, 2)])))
    thread.start()
    try:
        assert inside.wait(10)
        with pytest.raises(ExecutionError, match="another thread of this process is executing"):
            fd.execute([torch.ones(2, 2)])
    finally:
        release.set()
        thread.join(10)
    assert results and torch.equal(results[0][0], torch.ones(2, 2))
    monkeypatch.setitem(_ops.OPS, "relu", original)
    (out,) = fd.execute([-torch.ones(2, 2)])  # the lock was released
    assert torch.equal(out, torch.zeros(2, 2))


def test_recording_after_the_with_block_is_an_error():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 2])
        y = fd.ops.relu(x)
        fd.add_output(y)
    for record in (lambda: fd.ops.neg(x), lambda: fd.define_tensor([2]), lambda: fd.add_output(x)):
        with pytest.raises(DefinitionError, match=r"the definition is complete .* inside the block"):
            record()
    y.outer_split(0, 1)  # scheduling may go on after the block
    xi = torch.randn(4, 2)
    (out,) = fd.execute([xi])
    torch.testing.assert_close(out, torch.relu(xi))  # the failed calls recorded nothing
