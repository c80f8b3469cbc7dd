"""Every definition, schedule and execute-input error: its type, its bases and its message."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import tp_fusion
from tp_fusion import (
    DataType,
    DefinitionError,
    DeviceMesh,
    EmptyFusionError,
    FusionDefinition,
    InputError,
    LoweringError,
    ParallelType,
    ShardingError,
    TPFusionError,
    shard_tensor,
)
from tp_fusion.launch import RanksFailed
from tp_fusion.runtime import dist


def _raises(cls, match, fn, *, base=ValueError):
    """``fn()`` raises ``cls`` matching ``match``, which is a TPFusionError and a ``base``."""
    with pytest.raises(cls, match=match) as info:
        fn()
    assert isinstance(info.value, TPFusionError)
    assert isinstance(info.value, base)
    return info.value


def _fd_with(*shapes, dtype=DataType.Float):
    fd = FusionDefinition()
    return fd, [fd.define_tensor(list(s), dtype=dtype) for s in shapes]


def test_error_hierarchy():
    for cls in (DefinitionError, ShardingError, InputError):
        assert issubclass(cls, TPFusionError) and issubclass(cls, ValueError)
    assert issubclass(LoweringError, TPFusionError) and issubclass(LoweringError, NotImplementedError)
    # run_on_ranks' errors, which were the built-ins alone
    assert issubclass(tp_fusion.LaunchError, TPFusionError) and issubclass(tp_fusion.LaunchError, RuntimeError)
    assert issubclass(RanksFailed, tp_fusion.LaunchError)
    assert all(issubclass(tp_fusion.LaunchArgumentError, c) for c in (TPFusionError, ValueError, TypeError))


# --- definition errors -----------------------------------------------------------------------

def test_linear_in_extent_mismatch():
    fd, (x, w) = _fd_with((4, 8), (3, 16))
    err = _raises(DefinitionError, r"linear: the in extent of T0 f32\[4, 8\].*weight T1 f32\[3, 16\]",
                  lambda: fd.ops.linear(x, w))
    assert "8" in str(err) and "16" in str(err)
    assert len(fd.fusion.ops) == 0  # a rejected op is not recorded


def test_linear_bad_weight_and_bias():
    fd, (x, w1d, w, b) = _fd_with((4, 8), (6,), (3, 8), (4,))
    _raises(DefinitionError, r"linear: the in extent of T0 f32\[4, 8\] \(last dim\) must match the last dim of "
                             r"the weight T1 f32\[6\] \(\[out, in\] or \[in\]\)", lambda: fd.ops.linear(x, w1d))
    _raises(DefinitionError, r"linear: bias T3 f32\[4\] must be 1-D \[out\] with out = 3.*T2 f32\[3, 8\]",
            lambda: fd.ops.linear(x, w, b))


def test_linear_bad_weight_with_leading_dims():
    """nvFuser's logical-split linear: w[*lead, out, in] needs x's in extent last and a bias [*lead, out]."""
    fd, (x, w, b_flat, b_short, b) = _fd_with((2, 5, 8), (3, 6, 8), (18,), (6,), (3, 7))
    _raises(DefinitionError, r"linear: the in extent of T0 f32\[2, 5, 8\] \(last dim\) must match the last dim of "
                             r"the weight T5 f32\[3, 6, 4\] \[\*lead, out, in\]",
            lambda: fd.ops.linear(x, fd.define_tensor([3, 6, 4])))
    for bias in (b_flat, b_short, b):
        _raises(DefinitionError, rf"linear: bias T{bias.name} f32\[.*\] must be \[\*lead, out\] = \[3, 6\], the dims "
                                 r"of the weight T1 f32\[3, 6, 8\] but the last",
                lambda bias=bias: fd.ops.linear(x, w, bias))
    assert len(fd.fusion.ops) == 0


def _grouped_mm_operands(fd, m=8, k=4, g=3, n=6, dtype=DataType.Float, offsets=(3,), offsets_dtype=DataType.Int32):
    return (fd.define_tensor([m, k], dtype=dtype), fd.define_tensor([g, 4, n], dtype=dtype),
            fd.define_tensor(list(offsets), dtype=offsets_dtype))


@pytest.mark.parametrize("change,match", [
    ({"k": 5}, r"T0 f32\[8, 5\], T1 f32\[3, 4, 6\], T2 i32\[3\]: the contracted extent differs: dim 1 of mat1 "
               r"f32\[8, 5\] against dim 1 of mat2 f32\[3, 4, 6\] \(k\)"),
    ({"offsets": (4,)}, r"T2 i32\[4\]: offsets i32\[4\] must have one entry per group: g = 3 \(dim 0 of mat2 "
                        r"f32\[3, 4, 6\]\)"),
    ({"offsets": (3, 1)}, r"offsets i32\[3, 1\] must be a 1-D int32 \(or int64\) tensor \[g\]"),
    ({"offsets_dtype": DataType.Float}, r"offsets f32\[3\] must be a 1-D int32 \(or int64\) tensor \[g\]"),
    ({"dtype": DataType.Int}, r"mat1 and mat2 are i64; grouped_mm needs a floating dtype"),
], ids=["k", "offsets_length", "offsets_2d", "offsets_float", "int_operands"])
def test_bad_grouped_mm(change, match):
    fd = FusionDefinition()
    mat1, mat2, offsets = _grouped_mm_operands(fd, **change)
    _raises(DefinitionError, "grouped_mm: cannot apply to .*" + match, lambda: fd.ops.grouped_mm(mat1, mat2, offsets))
    assert len(fd.fusion.ops) == 0


def test_grouped_mm_bad_ranks_and_dtypes():
    fd = FusionDefinition()
    mat1, mat2, offsets = _grouped_mm_operands(fd)
    _raises(DefinitionError, r"grouped_mm: cannot apply to T3 f32\[2, 8, 4\], T1 f32\[3, 4, 6\], T2 i32\[3\]: mat1 "
                             r"must be \[m, k\] and mat2 \[g, k, n\]",
            lambda: fd.ops.grouped_mm(fd.define_tensor([2, 8, 4]), mat2, offsets))
    mat2_bf16 = fd.define_tensor([3, 4, 6], dtype=DataType.BFloat16)
    _raises(DefinitionError, r"grouped_mm: cannot apply .*: operands f32\[8, 4\], bf16\[3, 4, 6\] have different "
                             r"dtypes", lambda: fd.ops.grouped_mm(mat1, mat2_bf16, offsets))
    _raises(DefinitionError, r"grouped_mm: expected a TensorView for offsets, got \[3, 5, 8\]",
            lambda: fd.ops.grouped_mm(mat1, mat2, [3, 5, 8]))
    # nvFuser's other forms: valid there, not lowered here
    for a, b in (([8, 4], [4, 6]), ([3, 8, 4], [4, 6])):
        _raises(LoweringError, r"grouped_mm: mat1 T\d+ f32\[.*\] with mat2 T\d+ f32\[4, 6\] is a form of nvFuser's "
                               r"grouped_mm that tp_fusion does not support; it takes mat1 \[m, k\] with mat2 "
                               r"\[g, k, n\]",
                lambda a=a, b=b: fd.ops.grouped_mm(fd.define_tensor(a), fd.define_tensor(b), offsets),
                base=NotImplementedError)
    assert len(fd.fusion.ops) == 0


def test_bad_broadcast():
    fd, (a, b) = _fd_with((4, 8), (3, 8))
    _raises(DefinitionError, r"add: cannot apply to T0 f32\[4, 8\], T1 f32\[3, 8\]", lambda: fd.ops.add(a, b))
    _raises(DefinitionError, r"where: cannot apply", lambda: fd.ops.where(fd.ops.cast(a, DataType.Bool), a, b))


def test_bad_matmul():
    fd, (a, b) = _fd_with((4, 8), (6, 3))
    _raises(DefinitionError, r"matmul: cannot apply to T0 f32\[4, 8\], T1 f32\[6, 3\]", lambda: fd.ops.matmul(a, b))


def test_bad_reshape():
    fd, (x,) = _fd_with((4, 8))
    _raises(DefinitionError, r"reshape: cannot apply to T0 f32\[4, 8\].*\[5, 7\]", lambda: fd.ops.reshape(x, [5, 7]))


@pytest.mark.parametrize("dims", [[0], [0, 0, 1], [1, 2], [0, 1, 2, 0], [0, 4, 2], [0, 1, -4], [0, 1.0, 2]])
def test_bad_permute(dims):
    fd, (x,) = _fd_with((2, 3, 4))
    _raises(DefinitionError, r"permute: dims .* are not a permutation of T0's 3 dims f32\[2, 3, 4\]",
            lambda: fd.ops.permute(x, dims))


@pytest.mark.parametrize("op,call,msg", [
    ("sum", lambda fd, x: fd.ops.sum(x, [2]), r"sum: dim 2 is out of range for T0 f32\[4, 8\]"),
    ("mean", lambda fd, x: fd.ops.mean(x, [-3]), r"mean: dim -3 is out of range"),
    ("amax", lambda fd, x: fd.ops.amax(x, [0, -2]), r"amax: dims \[0, -2\] repeat a dim of T0"),
    ("var_mean", lambda fd, x: fd.ops.var_mean(x, [5]), r"var_mean: dim 5 is out of range"),
    ("softmax", lambda fd, x: fd.ops.softmax(x, 2), r"softmax: dim 2 is out of range"),
    ("squeeze2", lambda fd, x: fd.ops.squeeze(x, [3]), r"squeeze: dim 3 is out of range"),
    ("unsqueeze", lambda fd, x: fd.ops.unsqueeze(x, 3), r"unsqueeze: dim 3 is out of range for T0 f32\[4, 8\]"),
    ("unsqueeze-", lambda fd, x: fd.ops.unsqueeze(x, -4), r"unsqueeze: dim -4 is out of range"),
])
def test_bad_dims(op, call, msg):
    fd, (x,) = _fd_with((4, 8))
    _raises(DefinitionError, msg, lambda: call(fd, x))


@pytest.mark.parametrize("shape,bdims", [([4, 3], [0, 1]), ([2, 3, 4], [1, 0]), ([2, 3], [0]),
                                         ([2, 3], [0, 2]), ([2, 5, 3], [0, 1])])
def test_bad_broadcast_in_dim(shape, bdims):
    fd, (x,) = _fd_with((2, 3))
    _raises(DefinitionError, r"broadcast_in_dim: T0 f32\[2, 3\] cannot broadcast to",
            lambda: fd.ops.broadcast_in_dim(x, shape, bdims))


def test_bad_definition_arguments():
    fd, (x,) = _fd_with((2, 3))
    _raises(DefinitionError, r"define_tensor: shape \[2, -2\]", lambda: fd.define_tensor([2, -2]))
    _raises(DefinitionError, r"define_tensor: dtype must be a DataType",
            lambda: fd.define_tensor([2], dtype=torch.float32))
    _raises(DefinitionError, r"define_scalar: value must be a Python number", lambda: fd.define_scalar("a"))
    _raises(DefinitionError, r"gelu: approximate must be 'none' or 'tanh', got 'erf'",
            lambda: fd.ops.gelu(x, approximate="erf"))
    _raises(DefinitionError, r"cast: dtype must be a DataType .*; for a torch dtype, "
                             r"DataType.from_torch\(torch.float16\) is DataType.Half",
            lambda: fd.ops.cast(x, torch.float16))
    _raises(DefinitionError, r"relu: expected a TensorView", lambda: fd.ops.relu(torch.ones(2)))
    _raises(DefinitionError, r"mul: unsupported operand", lambda: fd.ops.mul(x, "2"))
    _raises(DefinitionError, r"mean: cannot apply to T\d+ i64\[2, 3\]",
            lambda: fd.ops.mean(fd.ops.cast(x, DataType.Int), [0]))
    _raises(DefinitionError, r"where: cannot apply .*bool", lambda: fd.ops.where(x, x, x))
    _raises(DefinitionError, r"layer_norm: cannot apply", lambda: fd.ops.layer_norm(x, [4]))
    _raises(DefinitionError, r"full: shape \[2, -1\] must be concrete", lambda: fd.ops.full([2, -1], 1.0,
                                                                                          DataType.Float))
    _raises(DefinitionError, r"output_shardings: run execute\(\) first", fd.output_shardings)


@pytest.mark.parametrize("dtype,hint", [(torch.float32, r"; for a torch dtype, DataType.from_torch\(torch.float32\) is "
                                                         r"DataType.Float$"),
                                        ("float", r"$")])
def test_define_scalar_takes_a_datatype(dtype, hint):
    """As define_tensor does (a torch dtype or a string was kept as the scalar's dtype)."""
    _raises(DefinitionError, rf"define_scalar: dtype must be a DataType \(e.g. DataType.Float\), got {dtype!r}{hint}",
            lambda: FusionDefinition().define_scalar(1, dtype))
    assert FusionDefinition().define_scalar(1, DataType.Null) == FusionDefinition().define_scalar(1)  # no dtype


def test_a_tensor_or_array_where_a_tensorview_goes_is_named_by_its_shape():
    """Not by its repr, which lists every element."""
    fd, (x,) = _fd_with((8, 4))
    err = _raises(DefinitionError, r"add: unsupported operand a torch.Tensor of shape \[8, 4\] \(define it with "
                                   r"fd.define_tensor and pass it to execute\); pass a TensorView or a number$",
                  lambda: fd.ops.add(x, torch.zeros(8, 4)))
    assert "0." not in str(err)
    _raises(DefinitionError, r"relu: expected a TensorView for x, got a numpy.ndarray of shape \[8, 4\]$",
            lambda: fd.ops.relu(np.zeros((8, 4))))
    _raises(DefinitionError, r"add: operands must be TensorViews or numbers, got a torch.Tensor of shape \[2\] "
                             r"\(define it with fd.define_tensor and pass it to execute\), 1$",
            lambda: fd.ops.add(torch.ones(2), 1))


def test_numpy_scalars_are_taken_as_python_numbers():
    """np.float32(2) and np.int64(3) in ops and define_scalar are the numbers they hold (were refused: 'pass a
    TensorView or a number'), with torch's promotion for a Python number (a Half tensor stays Half)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([3], dtype=DataType.Half)
        fd.add_output(fd.ops.mul(fd.ops.add(x, np.float32(0.5)), np.int64(3)))
        fd.add_output(fd.ops.mul(x, fd.define_scalar(np.float64(2.0), dtype=DataType.Double)))
        fd.add_output(fd.ops.where(fd.ops.gt(x, np.int32(1)), x, np.float16(0)))
    assert isinstance(fd.define_scalar(np.int64(4)).value, int)
    t = torch.tensor([0.0, 1.5, 2.0], dtype=torch.half)
    got = fd.execute([t])
    for out, want in zip(got, [(t + 0.5) * 3, t * 2.0, torch.where(t > 1, t, 0.0)]):
        torch.testing.assert_close(out, want)


def test_null_is_no_dtype_for_a_tensor():
    """DataType.Null (nvFuser's "no dtype") where an op makes a tensor of a given dtype is refused when
    recorded (cast to Null gave a tensor of dtype None: AttributeErrors when printed or executed)."""
    fd, (x,) = _fd_with((4,))
    for op, record in (("cast", lambda: fd.ops.cast(x, DataType.Null)),
                       ("full", lambda: fd.ops.full([2], 1.0, DataType.Null)),
                       ("define_tensor", lambda: fd.define_tensor([2], dtype=DataType.Null))):
        _raises(DefinitionError, rf"{op}: dtype must be a DataType other than Null \(e.g. DataType.Float\), got "
                                 r"DataType.Null", record)
    assert len(fd.fusion.tensors) == 1 and str(fd)  # nothing recorded; the definition still prints


def test_tensors_of_another_fusion():
    fd, (x,) = _fd_with((2, 3))
    other, (y,) = _fd_with((2, 3))
    _raises(DefinitionError, r"add: T0 belongs to another FusionDefinition", lambda: fd.ops.add(x, y))
    _raises(DefinitionError, r"add_output: expected a TensorView of this fusion", lambda: fd.add_output(y))
    _raises(DefinitionError, r"add_output: expected a TensorView", lambda: fd.add_output(torch.ones(2)))


def test_size_and_shape_of_another_fusions_tensor():
    """fd.ops.size/shape record no op, but a symbolic size they give names a tensor: of another fusion,
    T0 would bind to this fusion's T0 at execute."""
    other, (y,) = _fd_with((-1, 3))
    fd, (x,) = _fd_with((-1, 3))
    _raises(DefinitionError, r"size: T0 belongs to another FusionDefinition", lambda: fd.ops.size(y, 0))
    _raises(DefinitionError, r"shape: T0 belongs to another FusionDefinition", lambda: fd.ops.shape(y))


# --- schedule errors -------------------------------------------------------------------------

MESH2 = DeviceMesh(range(2))
MESH22 = DeviceMesh(torch.arange(4).reshape(2, 2))


def _tv(shape=(8, 6), mesh=MESH2):
    fd, (t,) = _fd_with(shape)
    if mesh is not None:
        t.set_device_mesh(mesh)
    return fd, t


def test_split_factor_must_divide_a_concrete_extent():
    fd, t = _tv()
    before = str(fd)
    err = _raises(ShardingError, r"T0: split factor 4 does not divide loop axis 1 of extent 6 "
                                 r"\(tensor shape \[8, 6\]\); use a factor that divides 6",
                  lambda: t.split(1, 4))
    assert "T0" in str(err)
    _raises(ShardingError, r"split factor 4 does not divide", lambda: t.outer_split(1, 4))
    _raises(ShardingError, r"T0.split: factor must be a positive int, got 0", lambda: t.split(0, 0))
    assert str(fd) == before  # a rejected split changes nothing


def test_split_of_a_symbolic_extent_is_checked_at_execute():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 6])
        fd.add_output(fd.ops.relu(x))
    x.outer_split(0, 4)  # nothing to check yet
    assert [x.axis(i).extent for i in range(3)] == [4, -1, 6]
    xi = torch.randn(8, 6)
    torch.testing.assert_close(fd.execute([xi])[0], torch.relu(xi))
    _raises(ShardingError, r"T0 f32\[\?, 6\]: dim 0 is symbolic and bound to 6 at execute, but its schedule "
                           r"splits it by 4, which does not divide 6; pass a size that is a multiple of 4",
            lambda: fd.execute([torch.ones(6, 6)]))


@pytest.mark.parametrize("call,msg", [
    (lambda t: t.split(2, 2),
     r"T0.split: axis 2 is out of range for a loop domain of 2 axes \(tensor shape \[8, 6\]\)"),
    (lambda t: t.outer_split(-3, 2), r"T0.split: axis -3 is out of range"),
    (lambda t: t.axis(2), r"T0.axis: axis 2 is out of range for a loop domain of 2 axes"),
    (lambda t: t.axis(-3), r"T0.axis: axis -3 is out of range"),
    (lambda t: t.axis("0"), r"T0.axis: the axis index must be an int \(a loop axis, negative ones count from the "
                            r"end\), got '0'$"),
    (lambda t: t.split(1.0, 2), r"T0.split: the axis index must be an int .*, got 1.0$"),
    (lambda t: t.rfactor([None]), r"T0.rfactor: the axis index must be an int .*, got None$"),
])
def test_axis_out_of_range_or_not_an_int(call, msg):
    _, t = _tv()
    _raises(ShardingError, msg, lambda: call(t))


def test_split_after_split_counts_loop_axes():
    _, t = _tv()
    t.outer_split(0, 2)  # loop [2, 4, 6]: axis 2 exists now
    t.split(2, 3)
    _raises(ShardingError, r"axis 4 is out of range for a loop domain of 4 axes", lambda: t.axis(4))


def test_device_parallel_type_used_twice():
    _, t = _tv(mesh=MESH22)
    t.outer_split(0, 2)
    t.axis(0).parallelize(ParallelType.mesh_x)
    t.outer_split(2, 2)
    _raises(ShardingError, r"T0: mesh_x is already bound to loop axis 0; a device parallel type may be used once",
            lambda: t.axis(2).parallelize(ParallelType.DIDx))


def test_parallelize_without_a_mesh():
    _, t = _tv(mesh=None)
    t.outer_split(0, 2)
    _raises(ShardingError, r"T0.axis\(0\).parallelize\(mesh_x\): the tensor has no device mesh; "
                           r"call set_device_mesh\(mesh\) first",
            lambda: t.axis(0).parallelize(ParallelType.mesh_x))


@pytest.mark.parametrize("ptype", [ParallelType.mesh_y, ParallelType.mesh_z])
def test_mesh_y_on_a_1d_mesh(ptype):
    _, t = _tv()
    t.outer_split(0, 2)
    _raises(ShardingError, rf"parallelize\({ptype.value}\): the mesh \[2\] has 1 axis\(es\); {ptype.value} needs more",
            lambda: t.axis(0).parallelize(ptype))


def test_outer_split_factor_not_the_mesh_size():
    _, t = _tv()
    t.outer_split(0, 4)
    _raises(ShardingError, r"T0 loop axis 0 \(mesh_x\): extent 4 must equal the mesh axis size 2; "
                           r"use outer_split\(axis, 2\)",
            lambda: t.axis(0).parallelize(ParallelType.mesh_x))
    assert t.axis(0).parallel_type is ParallelType.serial  # left as it was


def test_unsplit_axis_parallelized():
    _, t = _tv()  # axis 0 has extent 8, not 2
    _raises(ShardingError, r"extent 8 must equal the mesh axis size 2",
            lambda: t.axis(0).parallelize(ParallelType.mesh_x))


def test_split_after_parallelize():
    _, t = _tv()
    t.outer_split(0, 2)
    t.axis(0).parallelize(ParallelType.mesh_x)
    _raises(ShardingError, r"T0.split: loop axis 0 is parallelized on mesh_x; split before parallelizing",
            lambda: t.split(0, 2))


def test_set_device_mesh_needs_a_mesh():
    _, t = _tv(mesh=None)
    _raises(ShardingError, r"T0.set_device_mesh: expected a tp_fusion.DeviceMesh, got builtins.list$",
            lambda: t.set_device_mesh([0, 1]))
    torch_mesh = torch.distributed.device_mesh.DeviceMesh.__new__(torch.distributed.device_mesh.DeviceMesh)
    _raises(ShardingError, r"got torch.distributed.device_mesh.DeviceMesh \(torch's: build tp_fusion.DeviceMesh\(",
            lambda: t.set_device_mesh(torch_mesh))


def test_set_device_mesh_that_does_not_fit_the_schedule_leaves_the_tensor_unchanged():
    fd, t = _tv()
    t.outer_split(0, 2)
    t.axis(0).parallelize(ParallelType.mesh_x)
    before = str(fd)
    _raises(ShardingError, r"extent 2 must equal the mesh axis size 4", lambda: t.set_device_mesh(DeviceMesh(range(4))))
    assert str(fd) == before
    assert t.mesh == MESH2


def test_parallelize_needs_a_parallel_type():
    _, t = _tv()
    _raises(ShardingError, r"expected a ParallelType, got 'mesh_x'", lambda: t.axis(0).parallelize("mesh_x"))


@pytest.mark.parametrize("devices,msg", [
    ([0, 1, 1], r"DeviceMesh \[0, 1, 1\] repeats device\(s\) \[1\]; each rank may appear once"),
    (torch.tensor([[0, 1], [1, 0]]), r"repeats device\(s\) \[0, 1\]"),
    ([], r"DeviceMesh needs at least one device"),
    ([-1, 0], r"DeviceMesh devices must be ranks >= 0"),
    (torch.arange(16).reshape(2, 2, 2, 2), r"DeviceMesh has 4 axes; at most 3"),
])
def test_bad_device_mesh(devices, msg):
    _raises(ShardingError, msg, lambda: DeviceMesh(devices))


# --- execute-input errors --------------------------------------------------------------------

def _relu_fd(shape=(4, 8), dtype=DataType.Float):
    with FusionDefinition() as fd:
        x = fd.define_tensor(list(shape), dtype=dtype)
        fd.add_output(fd.ops.relu(x))
    return fd


@pytest.mark.parametrize("inputs,msg", [
    ([], r"execute: the fusion takes 1 inputs \(T0\), got 0"),
    ([torch.ones(4, 8), torch.ones(4, 8)], r"execute: the fusion takes 1 inputs \(T0\), got 2"),
])
def test_wrong_number_of_inputs(inputs, msg):
    _raises(InputError, msg, lambda: _relu_fd().execute(inputs))


def test_wrong_dtype():
    _raises(InputError, r"execute: input T0 has dtype torch.float64, the fusion defines it as torch.float32; "
                        r"cast it or change define_tensor's dtype",
            lambda: _relu_fd().execute([torch.ones(4, 8, dtype=torch.float64)]))
    _raises(InputError, r"has dtype torch.float32, the fusion defines it as torch.bfloat16",
            lambda: _relu_fd(dtype=DataType.BFloat16).execute([torch.ones(4, 8)]))


def test_wrong_shape():
    _raises(InputError, r"execute: input T0 dim 1 has local extent 7; it is not sharded \(global extent 8\).*"
                        r"expected local shape \[4, 8\]",
            lambda: _relu_fd().execute([torch.ones(4, 7)]))
    _raises(InputError, r"execute: input T0 has 1 dims \[4\], the fusion defines 2 dims \[4, 8\]",
            lambda: _relu_fd().execute([torch.ones(4)]))
    _raises(InputError, r"input T0 has 3 dims", lambda: _relu_fd(shape=(-1, 8)).execute([torch.ones(2, 4, 8)]))


@pytest.mark.parametrize("value,name", [(3.0, "float"), ([1.0, 2.0], "list"), (None, "NoneType")])
def test_non_tensor_input(value, name):
    _raises(InputError, rf"execute: input T0 must be a torch.Tensor, got {name}", lambda: _relu_fd().execute([value]))


@pytest.mark.parametrize("cached", [False, True])
def test_sparse_input(cached):
    """Refused also where a dense tensor of its shape has a plan already (before: a raw storage error)."""
    fd = _relu_fd()
    if cached:
        fd.execute([torch.ones(4, 8)])
    _raises(InputError, r"execute: input T0 has layout torch.sparse_coo; pass a dense tensor",
            lambda: fd.execute([torch.eye(4, 8).to_sparse()]))


def test_extents_and_factors_are_integers():
    """numpy integers are extents, as torch takes them; bools and floats are not."""
    np = pytest.importorskip("numpy")
    with FusionDefinition() as fd:
        x = fd.define_tensor([np.int64(4), 8])
        assert x.shape == (4, 8) and all(type(e) is int for e in x.shape)
        _raises(DefinitionError, r"define_tensor: shape \[2.0, 3\] must be a list of integer extents",
                lambda: fd.define_tensor([2.0, 3]))
        _raises(DefinitionError, r"define_tensor: shape 8 must be a list of integer extents",
                lambda: fd.define_tensor(8))
        fd.add_output(fd.ops.relu(x))
        x.set_device_mesh(DeviceMesh([0]))
        _raises(ShardingError, r"T0.split: factor must be a positive int, got True", lambda: x.outer_split(0, True))
        x.outer_split(0, np.int64(1))
    for bad in ([4.5, 8], [-2, 8], [True, 8]):
        _raises(InputError, r"compile: input T0 is defined as \[4, 8\], got global shape",
                lambda bad=bad: fd.compile([bad]))


def test_compile_arguments():
    """fd.compile needs one concrete global shape per input and a rank >= 0 (a symbolic extent was reported as
    a shape mismatch, a flat shape as a TypeError, and rank 'a' or -1 built a plan)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 4])
        fd.add_output(fd.ops.relu(x))
        x.set_device_mesh(MESH2)
        x.outer_split(0, 2).axis(0).parallelize(ParallelType.mesh_x)
    _raises(InputError, r"compile: input T0 is given the global shape \[-1, 4\]; a plan is built for concrete global "
                        r"shapes: give each symbolic extent of \[-1, 4\] its size", lambda: fd.compile([[-1, 4]]))
    _raises(InputError, r"compile: input T0 is defined as \[-1, 4\], got global shape 8; input_shapes holds one list "
                        r"of extents per input", lambda: fd.compile([8]))
    _raises(InputError, r"compile: expected a list of 1 global shape, one per input \(T0\), got 8",
            lambda: fd.compile(8))
    for rank in ("a", -1, 1.0, True):
        _raises(InputError, rf"compile: rank must be the rank \(an int >= 0\) whose plan to build, got {rank!r}",
                lambda rank=rank: fd.compile([[8, 4]], rank=rank))
    _raises(InputError, r"compile: input T0 is defined as \[-1, 4\], got global shape a torch.float32 tensor of "
                        r"shape \[8, 4\] \(a tensor: give its shape, list\(t.shape\)\)",
            lambda: fd.compile([torch.zeros(8, 4)]))  # was a bare TypeError from torch
    assert fd.compile([[8, 4]], rank=np.int64(1)).rank == 1
    for device in ("tpu", 3.5):  # torch's own RuntimeError and TypeError before
        _raises(InputError, rf"compile: device must be a torch.device or its name \('cpu', 'cuda'\), got {device!r}",
                lambda device=device: fd.compile([[8, 4]], device=device))


def test_a_rejected_input_does_not_poison_the_fusion():
    fd = _relu_fd()
    _raises(InputError, r"local extent 7", lambda: fd.execute([torch.ones(4, 7)]))
    x = torch.randn(4, 8)
    (out,) = fd.execute([x])
    torch.testing.assert_close(out, torch.relu(x))


def test_symbolic_extents_that_disagree_at_execute():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 8])
        w = fd.define_tensor([4, 8])
        y = fd.define_tensor([-1, 4])
        fd.add_output(fd.ops.add(fd.ops.linear(x, w), y))
    _raises(InputError, r"execute: the inputs' sizes do not fit the fusion: add: cannot apply to "
                        r"T3 f32\[3, 4\], T2 f32\[5, 4\]",
            lambda: fd.execute([torch.ones(3, 8), torch.ones(4, 8), torch.ones(5, 4)]))


def _sharded_on_two():
    mesh = DeviceMesh(range(2))
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 8])
        fd.add_output(fd.ops.relu(x))
        x.set_device_mesh(mesh)
        x.outer_split(0, 2)
        x.axis(0).parallelize(ParallelType.mesh_x)
    return fd


@pytest.mark.skipif(dist.is_initialized(), reason="needs no process group")
def test_sharded_fusion_without_a_process_group_is_an_input_error():
    """Rejected before anything runs, as an InputError that says to start a process group."""
    fd = _sharded_on_two()
    _raises(InputError, re.escape("the fusion's meshes name ranks other than 0, but no torch.distributed process "
                                  "group is initialized"),
            lambda: fd.execute([torch.ones(2, 8)]))
    assert fd.plan is None


def test_fusion_on_a_mesh_of_rank_0_alone_runs_without_a_process_group():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 8])
        fd.add_output(fd.ops.relu(x))
        x.set_device_mesh(DeviceMesh([0]))
    xi = torch.randn(4, 8)
    (out,) = fd.execute([xi])
    torch.testing.assert_close(out, torch.relu(xi))


@pytest.mark.skipif(dist.is_initialized(), reason="needs no process group")
def test_missing_process_group_is_reported_before_shapes():
    fd = _sharded_on_two()  # full tensors and no process group: the missing group is the clearer error
    _raises(InputError, r"no torch.distributed process group is initialized",
            lambda: fd.execute([torch.ones(4, 8)]))


def test_a_fusion_without_outputs_is_an_error_at_its_first_use():
    """No add_output (or a FusionDefinition never entered): execute and compile say so, where an empty list
    of outputs would fail far from the cause."""
    with FusionDefinition() as fd:
        fd.ops.relu(fd.define_tensor([4]))
    for fusion, state in ((fd, "Fusion is empty! It has no outputs"), (FusionDefinition(), "Fusion does not exist!")):
        _raises(EmptyFusionError, rf"execute: {state}.* fd.add_output\(tv\)",
                lambda fusion=fusion: fusion.execute([torch.ones(4)]))
        assert issubclass(EmptyFusionError, (DefinitionError, NotImplementedError))  # as nvFuser's error
    _raises(EmptyFusionError, r"compile: Fusion is empty! It has no outputs", lambda: fd.compile([[4]]))


def test_a_split_left_unparallelized_is_named_when_the_input_does_not_fit():
    """A dim split but never parallelized stays whole: a shard passed for it gets an error that says so and
    how to shard it (was "its global extent 8 gives 8")."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 4])
        fd.add_output(fd.ops.relu(x))
        x.set_device_mesh(DeviceMesh([0]))
        x.outer_split(0, 2)
    _raises(InputError, r"input T0 dim 0 has local extent 4; it is not sharded \(global extent 8\): it was split "
                        r"into loop axes \[0, 1\], none of them parallelized; to shard it, call "
                        r"T0.axis\(0\).parallelize\(ParallelType.mesh_x\)\. Pass",
            lambda: fd.execute([torch.ones(4, 4)]))
    _raises(InputError, r"input T0 dim 1 has local extent 2; it is not sharded \(global extent 4\)\. Pass",
            lambda: fd.execute([torch.ones(8, 2)]))


def test_a_dim_sharded_on_a_mesh_axis_of_size_1_is_named_sharded():
    """At world 1 a parallelized dim splits 1 way: a wrong local extent is reported as at worlds 2 and 4
    (was "it is not sharded ... none of them parallelized", naming the call that was made)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 4])
        fd.add_output(fd.ops.relu(x))
        x.set_device_mesh(DeviceMesh([0]))
        x.outer_split(0, 1)
        x.axis(0).parallelize(ParallelType.mesh_x)
    err = _raises(InputError, r"input T0 dim 0 has local extent 7; its global extent 8 split 1 way gives 8\. Pass "
                              r"this rank's shard .*expected local shape \[8, 4\]",
                  lambda: fd.execute([torch.ones(7, 4)]))
    assert "not sharded" not in str(err) and "parallelized" not in str(err)


@pytest.mark.parametrize("op", ["amax", "max", "amin", "min"])
def test_max_and_min_of_no_elements(op):
    """torch has no max or min of no elements: a reduced dim of extent 0 is refused when recorded, and a
    symbolic one bound to 0 with the other size checks at execute (InputError before running; was an
    ExecutionError from inside the plan)."""
    with FusionDefinition() as fixed:
        x = fixed.define_tensor([0, 4])
        _raises(DefinitionError, rf"{op}: cannot apply to T0 f32\[0, 4\]: dim 0 has extent 0: torch has no a"
                                 rf"{op[-3:]} of no elements", lambda: getattr(fixed.ops, op)(x, [0]))
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 4])
        fd.add_output(getattr(fd.ops, op)(x, [0]))
    _raises(InputError, rf"execute: the inputs' sizes do not fit the fusion: {op}: cannot apply to T0 f32\[0, 4\]: "
                        rf"dim 0 has extent 0: torch has no a{op[-3:]} of no elements",
            lambda: fd.execute([torch.ones(0, 4)]))
    assert fd.plan is None
    torch.testing.assert_close(fd.execute([torch.ones(3, 4)])[0], torch.ones(4))


def _topk(fd):
    return fd.ops.topk(fd.define_tensor([2, -1]), 2, 1)[0]


def _select(fd):
    return fd.ops.select(fd.define_tensor([-1, 3]), -3, 0)


def _expand(fd):
    return fd.ops.expand(fd.define_tensor([-1, 3]), [4, 3])


def _full(fd):
    return fd.ops.full([fd.define_scalar(None, dtype=DataType.Int), 2], 1.0, DataType.Float)


def _reshape(fd):
    return fd.ops.reshape(fd.define_tensor([-1]), [fd.define_scalar(None, dtype=DataType.Int), -1])


@pytest.mark.parametrize("build,bad,good,match", [
    (_topk, [torch.ones(2, 1)], [torch.ones(2, 3)], r"topk: cannot apply to T0 f32\[2, 1\]: k 2 is out of range"),
    (_select, [torch.ones(2, 3)], [torch.ones(3, 3)], r"select: cannot apply to T0 f32\[2, 3\]: index -3 is out of "),
    (_expand, [torch.ones(2, 3)], [torch.ones(1, 3)], r"broadcast_in_dim: cannot apply to T0 f32\[2, 3\]: .* dim 0 "
                                                      r"has extent 2, neither 1 nor 4"),
    (_full, [-2], [3], r"full: shape \[-2, 2\] has a negative extent"),
    (_reshape, [torch.ones(6), -2], [torch.ones(6), 2], r"reshape: cannot apply to T0 f32\[6\]: shape \[-2, -1\] has "
                                                        r"a negative extent"),
])
def test_extents_bound_at_execute_are_checked_before_running(build, bad, good, match):
    """What an op's front end checks on extents known when recorded, its inference checks too, which execute runs
    once symbolic extents and scalar inputs are bound: an InputError before running (was an ExecutionError from
    inside the plan, which tears a process group down; found by test_properties_sizes: a top-2 of a symbolic dim
    bound to 0)."""
    with FusionDefinition() as fd:
        fd.add_output(build(fd))
    _raises(InputError, r"execute: the inputs' sizes do not fit the fusion: " + match, lambda: fd.execute(bad))
    assert fd.plan is None
    fd.execute(good)


@pytest.mark.parametrize("call,msg", [
    (lambda full, t: shard_tensor(full.numpy(), t),
     r"shard_tensor: full must be a torch.Tensor \(the whole, unsharded value\), got numpy.ndarray; "
     r"torch.from_numpy\(full\) converts a numpy array"),
    (lambda full, t: shard_tensor(full.tolist(), t), r"full must be a torch.Tensor .*, got builtins.list$"),
    (lambda full, t: shard_tensor(full, None), r"shard_tensor: expected a TensorView \(or a Sharding, e.g. "
                                               r"fd.output_shardings\(\)\[i\]\) to shard by, got None"),
    (lambda full, t: shard_tensor(full, "T0"), r"expected a TensorView .* to shard by, got 'T0'"),
    (lambda full, t: shard_tensor(full, t, rank="1"),
     r"shard_tensor: rank must be a rank of the process group \(an int >= 0\), or None for this rank, got '1'"),
    (lambda full, t: shard_tensor(full, t, rank=-1), r"rank must be .*, got -1"),
    (lambda full, t: shard_tensor(full, t, rank=True), r"rank must be .*, got True"),
])
def test_shard_tensor_arguments(call, msg):
    """Arguments of the wrong kind are an InputError (were AttributeErrors, or an empty shard for a rank of
    '1' or -1, as for a rank outside the mesh)."""
    _, t = _tv()
    t.outer_split(0, 2).axis(0).parallelize(ParallelType.mesh_x)
    full = torch.arange(48.0).reshape(8, 6)
    _raises(InputError, msg, lambda: call(full, t))
    assert shard_tensor(full, t, rank=np.int64(1)).shape == (4, 6) and shard_tensor(full, t, rank=5).numel() == 0


@pytest.mark.parametrize("op", ["fmod", "mod", "remainder"])
def test_an_op_that_fails_at_run_time_is_named(op):
    """An integer remainder by zero: aten on the CPU refuses it with only 'ZeroDivisionError' (nvFuser's CUDA
    kernels give no defined value); the ExecutionError ends with the step that failed. Integer ``div`` and
    ``truediv`` divide as torch's true division (inf and nan where the divisor is 0, no error)."""
    with FusionDefinition() as fd:
        a, b = fd.define_tensor([4], dtype=DataType.Int), fd.define_tensor([4], dtype=DataType.Int)
        fd.add_output(getattr(fd.ops, op)(fd.ops.add(a, 1), b))
        fd.add_output(fd.ops.div(a, b))
    x, y = torch.tensor([5, -7, 2, 0]), torch.tensor([2, 3, 0, -2])
    _raises(tp_fusion.ExecutionError, rf"^rank 0 failed in segment 0 \(compute\): RuntimeError: ZeroDivisionError "
                                      rf"\(at T3 = {op}\(T2, T1\)\)$", lambda: fd.execute([x, y]), base=RuntimeError)
    ref = {"fmod": torch.fmod, "mod": torch.fmod, "remainder": torch.remainder}[op]
    y = torch.tensor([2, 3, -3, -2])
    rem, quotient = fd.execute([x, y])
    torch.testing.assert_close(rem, ref(x + 1, y))
    torch.testing.assert_close(quotient, torch.div(x, y))
    with FusionDefinition() as div:
        a, b = div.define_tensor([4], dtype=DataType.Int), div.define_tensor([4], dtype=DataType.Int)
        div.add_output(div.ops.div(a, b))
    zeros = torch.tensor([2, 0, 0, 0])
    got = div.execute([x, zeros])[0]
    torch.testing.assert_close(got, torch.tensor([2.5, -torch.inf, torch.inf, torch.nan]), equal_nan=True)
