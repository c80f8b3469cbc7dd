"""Outputs aliased to inputs (``fd.add_output(tv, alias_input=)``, written in place and not returned, as
nvFuser's) and ``fd.validate`` (execute, then compare with given references or with the fusion's ops
evaluated one by one on the whole inputs, under nvFuser's tolerances), on one process."""

from __future__ import annotations

import pytest
import torch

from tp_fusion import (
    DataType,
    DefinitionError,
    DeviceMesh,
    FusionDefinition,
    InputError,
    ValidationError,
    autograd,
)
from tp_fusion.validate import reference, tolerance


def _updated(x_dtype=DataType.Float):
    """t0 -> t1 = t0 + 1 (aliased to t0), t2 = t1 * 2 (returned)."""
    with FusionDefinition() as fd:
        t0 = fd.define_tensor([4, 3], dtype=x_dtype)
        t1 = fd.ops.add(t0, 1.0)
        fd.add_output(t1, alias_input=t0)
        fd.add_output(fd.ops.mul(t1, 2.0))
    return fd


def test_an_aliased_output_is_written_into_its_input_and_not_returned():
    x = torch.randn(4, 3)
    before = x.clone()
    fd = _updated()
    (y,) = fd.execute([x])
    torch.testing.assert_close(x, before + 1)
    torch.testing.assert_close(y, (before + 1) * 2)
    assert len(fd.output_shardings()) == 1
    assert "T1 written into input T0" in str(fd.plan)
    assert "output 0 (T1) aliased to input T0" in str(fd)
    (y,) = fd.execute([x])  # again: reads the updated input
    torch.testing.assert_close(x, before + 2)
    torch.testing.assert_close(y, (before + 2) * 2)


def test_aliased_and_plain_outputs_of_one_tensor_are_the_input_itself():
    # nvFuser's test_returning_aliased_outputs: the aliased write is hidden; the plain outputs of the
    # aliased tensor and of the input are the input's buffer, which holds the new values.
    x = torch.randn(2, 3)
    relu = x.clamp(min=0)
    with FusionDefinition() as fd:
        t0 = fd.define_tensor([-1, -1])
        t1 = fd.ops.where(fd.ops.gt(t0, 0.0), t0, 0.0)
        fd.add_output(t1)
        fd.add_output(t1, t0)  # positional, as nvFuser's
        fd.add_output(t1)
        fd.add_output(t0)
    outs = fd.execute([x])
    assert len(outs) == 3 and all(o is x for o in outs)
    torch.testing.assert_close(x, relu)


def test_an_input_aliased_to_another_input_is_copied_into_it():
    a, b = torch.randn(3), torch.zeros(3)
    with FusionDefinition() as fd:
        t0, t1 = fd.define_tensor([3]), fd.define_tensor([3])
        fd.add_output(t0, alias_input=t1)
        fd.add_output(fd.ops.neg(t1))
    (y,) = fd.execute([a, b])
    torch.testing.assert_close(b, a)
    torch.testing.assert_close(y, torch.zeros(3))  # the input's value before the write


def test_an_aliased_write_goes_into_a_strided_input_and_a_parameter():
    w = torch.nn.Parameter(torch.randn(3, 4).t())  # non-contiguous, requires grad
    before = w.detach().clone()
    with FusionDefinition() as fd:
        t0 = fd.define_tensor([4, 3])
        fd.add_output(fd.ops.mul(t0, 0.5), alias_input=t0)
        fd.add_output(fd.ops.sum(t0, [0]))
    (s,) = fd.execute([w])
    torch.testing.assert_close(w.detach(), before * 0.5)
    torch.testing.assert_close(s, before.sum(0))
    assert w.requires_grad and not s.requires_grad


def test_aliasing_on_a_mesh_of_one_device():
    x = torch.randn(4, 6)
    before = x.clone()
    with FusionDefinition() as fd:
        t0 = fd.define_tensor([4, 6])
        t1 = fd.ops.exp(t0)
        fd.add_output(t1, alias_input=t0)
        t0.set_device_mesh(DeviceMesh([0]))
    assert fd.execute([x]) == []
    torch.testing.assert_close(x, before.exp())


@pytest.mark.parametrize("bad, match", [
    (lambda fd, t0, t1, u: fd.add_output(t1, alias_input=t1), "must be an input of this fusion"),
    (lambda fd, t0, t1, u: fd.add_output(t1, alias_input=torch.zeros(4, 3)), "got a torch.Tensor"),
    (lambda fd, t0, t1, u: fd.add_output(fd.ops.sum(t1, [0]), alias_input=t0), r"shape and dtype, f32\[4, 3\]"),
    (lambda fd, t0, t1, u: fd.add_output(fd.ops.cast(t1, DataType.Double), alias_input=t0), "shape and dtype"),
    (lambda fd, t0, t1, u: (fd.add_output(t1, alias_input=t0), fd.add_output(t1, alias_input=u)),
     "already aliased to input T0"),
    (lambda fd, t0, t1, u: (fd.add_output(t1, alias_input=t0), fd.add_output(u, alias_input=t0)),
     "already aliased to input T0"),
])
def test_bad_aliases_are_refused_at_definition(bad, match):
    with pytest.raises(DefinitionError, match=match):
        with FusionDefinition() as fd:
            t0, u = fd.define_tensor([4, 3]), fd.define_tensor([4, 3])
            bad(fd, t0, fd.ops.neg(t0), u)


def test_an_alias_input_of_another_fusion_is_refused():
    with FusionDefinition() as other:
        o = other.define_tensor([2])
    with pytest.raises(DefinitionError, match="must be an input of this fusion"):
        with FusionDefinition() as fd:
            fd.add_output(fd.ops.neg(fd.define_tensor([2])), alias_input=o)


def test_symbolic_extents_that_bind_to_other_sizes_are_refused_at_execute():
    with FusionDefinition() as fd:
        t0, t1 = fd.define_tensor([-1]), fd.define_tensor([-1])
        fd.add_output(fd.ops.neg(t1), alias_input=t0)
        fd.add_output(t1)
    x = torch.zeros(3)
    with pytest.raises(InputError, match=r"aliased to input T0 .*make it \[4\] and T0 \[3\]"):
        fd.execute([x, torch.ones(4)])
    assert torch.equal(x, torch.zeros(3))


def test_autograd_refuses_a_fusion_with_aliased_outputs():
    fd = _updated()
    with FusionDefinition() as bwd:
        bwd.add_output(bwd.define_tensor([4, 3]))
    with pytest.raises(DefinitionError, match="forward fusion writes an output into its input"):
        autograd.function(fd, bwd)


# --- validate ------------------------------------------------------------------------------------------


def _mlp():
    with FusionDefinition() as fd:
        x, w, b = fd.define_tensor([8, 16]), fd.define_tensor([32, 16]), fd.define_tensor([32])
        h = fd.ops.gelu(fd.ops.linear(x, w, b), approximate="tanh")
        fd.add_output(fd.ops.softmax(h, 1))
        fd.add_output(fd.ops.sum(h, [1]))
        fd.add_output(fd.ops.gt(h, 0.0))
    return fd


def test_validate_returns_the_outputs_checked_against_the_ops_evaluated_one_by_one():
    x, w, b = torch.randn(8, 16), torch.randn(32, 16), torch.randn(32)
    fd = _mlp()
    outs = fd.validate([x, w, b])
    h = torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b), approximate="tanh")
    torch.testing.assert_close(outs[0], h.softmax(1))
    torch.testing.assert_close(outs[1], h.sum(1))
    assert len(outs) == 3


def test_validate_against_given_references():
    x, w, b = torch.randn(8, 16), torch.randn(32, 16), torch.randn(32)
    fd = _mlp()
    h = torch.nn.functional.gelu(torch.nn.functional.linear(x.double(), w.double(), b.double()), approximate="tanh")
    third = fd.execute([x, w, b])[2]
    fd.validate([x, w, b], [h.softmax(1), h.sum(1), third])  # float64 references: compared in float64
    with pytest.raises(ValidationError, match=r"output 1 \(T\d+ f32\[8\]\): max abs difference 0\.5\d* .*atol="):
        fd.validate([x, w, b], [h.softmax(1), h.sum(1) + 0.5, third])
    fd.validate([x, w, b], [h.softmax(1), h.sum(1) + 0.5, third], atol=0.6)
    with pytest.raises(ValidationError, match="output 2 .*differ from the reference's"):
        fd.validate([x, w, b], [h.softmax(1), h.sum(1), ~third])
    with pytest.raises(ValidationError, match=r"output 0 .*reference has shape \[8\]"):
        fd.validate([x, w, b], [h.sum(1), h.sum(1), third])
    with pytest.raises(InputError, match=r"one tensor per output execute returns \(3"):
        fd.validate([x, w, b], [h.softmax(1)])


def test_validate_with_aliases_computes_the_references_before_writing():
    x = torch.randn(4, 3)
    before = x.clone()
    fd = _updated()
    (y,) = fd.validate([x])
    torch.testing.assert_close(y, (before + 1) * 2)
    torch.testing.assert_close(x, before + 1)
    with pytest.raises(InputError, match=r"one tensor per output execute returns \(1: T2\)"):
        fd.validate([x], [y, y])


def test_the_reference_interpreter_runs_factories_views_and_seeded_draws():
    with FusionDefinition() as fd:
        t0, t1 = fd.define_tensor([-1, 6]), fd.define_tensor([5, 6])
        r = fd.ops.reshape(t1, [5, 2, 3])
        full = fd.ops.full([2, 3], 2.0, DataType.Float)
        u = fd.ops.uniform(0.0, 1.0, [2, 3], rng_seed=7, rng_offset=0)
        fd.add_output(fd.ops.add(fd.ops.mul(r, full), u))
        fd.add_output(fd.ops.slice(t0, [0, 1], [t0.size(0), 4]))
        fd.add_output(fd.ops.broadcast_in_dim(fd.ops.iota(6, dtype=DataType.Float), [t0.size(0), 6], [1]))
    x, y = torch.randn(5, 6), torch.randn(5, 6)
    fd.validate([x, y], rtol=0, atol=0)  # the plan runs the same aten implementations: equal
    got = reference(fd.fusion, [x, y])
    torch.testing.assert_close(got[1], x[:, 1:4])
    torch.testing.assert_close(got[2], torch.arange(6.0).expand(5, 6))


def test_an_unseeded_draw_has_no_reference():
    with FusionDefinition() as fd:
        fd.add_output(fd.ops.add(fd.define_tensor([3]), fd.ops.uniform(0.0, 1.0, [3])))
    with pytest.raises(InputError, match="unseeded random numbers.*pass reference_outputs"):
        fd.validate([torch.zeros(3)])
    fd.validate([torch.zeros(3)], [torch.full((3,), 0.5)], atol=0.5)


def test_validate_checks_the_inputs_as_execute_does():
    fd = _updated()
    with pytest.raises(InputError, match="dtype torch.float64"):
        fd.validate([torch.zeros(4, 3, dtype=torch.float64)])


def test_tolerances_are_nvfusers():
    assert tolerance(DataType.Float, 1) == (1.68222e-06, 2.23704e-06)
    assert tolerance(DataType.Half, 1) == (0.00390625, 0.0078125)
    assert tolerance(DataType.Float, 16) == (4.4778e-06, 4.4778e-08)  # the next entry up, rtol 1% of it
    assert tolerance(DataType.BFloat16, 16) == pytest.approx((0.155334, 0.00155334))
    assert tolerance(DataType.Float, 10**8) == (0.00343043 * 2, 0.00343043 * 2 * 0.01)
    assert tolerance(DataType.Int, 1024) == (0.0, 0.0)
