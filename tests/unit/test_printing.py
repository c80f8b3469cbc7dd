"""Golden ``print(fd)`` texts (exact compare) and the immutability of the IR under them."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

from tp_fusion import DataType, DeviceMesh, FusionDefinition, ParallelType
from tp_fusion.ir import Const, Fusion, LoopAxis, Op, Segment, Tensor

ROOT = Path(__file__).resolve().parents[2]


def _tp_mlp_module():
    spec = importlib.util.spec_from_file_location("tp_mlp_example", ROOT / "examples" / "tp_mlp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _small_fusion() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 8])
        y = fd.define_tensor([8], dtype=DataType.BFloat16)
        c = fd.define_tensor([-1, 8], dtype=DataType.Bool)
        s = fd.ops.mul(fd.ops.add(x, y), fd.define_scalar(0.5))
        v, mu = fd.ops.var_mean(s, [0], correction=0)
        fd.add_output(fd.ops.where(c, s, 0.0))
        fd.add_output(fd.ops.cast(v, DataType.BFloat16))
        fd.add_output(mu)
        fd.add_output(fd.ops.permute(fd.ops.unsqueeze(s, 0), [1, 0, 2]))
    return fd


SMALL = """\
Fusion(inputs=[T0, T1, T2], outputs=[T7, T8, T6, T10])
  T0 = input : f32[?, 8]
  T1 = input : bf16[8]
  T2 = input : bool[?, 8]
  T3 = add(T0, T1) : f32[?, 8]
  T4 = mul(T3, 0.5) : f32[?, 8]
  T5, T6 = var_mean(T4, dims=[0], correction=0, keepdim=False) : f32[8] f32[8]
  T7 = where(T2, T4, 0.0) : f32[?, 8]
  T8 = cast(T5, dtype=DataType.BFloat16) : bf16[8]
  T9 = unsqueeze(T4, dim=0) : f32[1, ?, 8]
  T10 = permute(T9, dims=[1, 0, 2]) : f32[?, 1, 8]"""

SMALL_PLAN = """\
Plan: 1 segment(s); inputs [T0, T1, T2], outputs [T7, T8, T6, T10]
  segment 0: compute
    T3 = add(T0, T1) : f32[3, 8]
    T4 = mul(T3, 0.5) : f32[3, 8]
    T5, T6 = var_mean(T4, dims=[0], correction=0, keepdim=False) : f32[8] f32[8]
    T7 = where(T2, T4, 0.0) : f32[3, 8]
    T8 = cast(T5, dtype=DataType.BFloat16) : bf16[8]
    T9 = unsqueeze(T4, dim=0) : f32[1, 3, 8]
    T10 = permute(T9, dims=[1, 0, 2]) : f32[3, 1, 8]"""

MLP_SP_2 = """\
Fusion(inputs=[T0, T1, T2, T3, T4], outputs=[T7])
  T0 = input : bf16[64, 32] @mesh(0 1)[mesh_x{2}, 32, 32]
  T1 = input : bf16[128, 32] @mesh(0 1)[mesh_x{2}, 64, 32]
  T2 = input : bf16[128] @mesh(0 1)[mesh_x{2}, 64]
  T3 = input : bf16[32, 128] @mesh(0 1)[32, mesh_x{2}, 64]
  T4 = input : bf16[32] @mesh(0 1)[32]
  T5 = linear(T0, T1, T2) : bf16[64, 128]
  T6 = gelu(T5, approximate='tanh') : bf16[64, 128]
  T7 = linear(T6, T3, T4) : bf16[64, 32] @mesh(0 1)[mesh_x{2}, 32, 32, r{128}]"""

MLP_TP_4 = """\
Fusion(inputs=[T0, T1, T2, T3, T4], outputs=[T7])
  T0 = input : f32[16, 8] @mesh(0 1 2 3)[16, 8]
  T1 = input : f32[32, 8] @mesh(0 1 2 3)[mesh_x{4}, 8, 8]
  T2 = input : f32[32] @mesh(0 1 2 3)[mesh_x{4}, 8]
  T3 = input : f32[8, 32] @mesh(0 1 2 3)[8, mesh_x{4}, 8]
  T4 = input : f32[8] @mesh(0 1 2 3)[8]
  T5 = linear(T0, T1, T2) : f32[16, 32]
  T6 = gelu(T5, approximate='tanh') : f32[16, 32]
  T7 = linear(T6, T3, T4) : f32[16, 8] @mesh(0 1 2 3)[16, 8, r{32}]"""

MESH_2D = """\
Fusion(inputs=[T0, T1], outputs=[T2])
  T0 = input : bf16[?, 8] @mesh(2x2: 0 1 2 3)[mesh_y{2}, ?, 8]
  T1 = input : bf16[16, 8] @mesh(2x2: 0 1 2 3)[mesh_x{2}, 8, 2, 4]
  T2 = linear(T0, T1) : bf16[?, 16] @mesh(2x2: 0 1 2 3)[?, 16, r{8}]"""


def test_small_fusion_golden():
    assert str(_small_fusion()) == SMALL


def test_print_writes_str(capsys):
    print(_small_fusion())
    assert capsys.readouterr().out == SMALL + "\n"


def test_small_plan_golden():
    fd = _small_fusion()
    assert fd.plan is None
    fd.execute([torch.randn(3, 8), torch.randn(8, dtype=torch.bfloat16), torch.ones(3, 8, dtype=torch.bool)])
    assert str(fd.plan) == SMALL_PLAN
    assert str(fd) == SMALL  # the definition keeps its symbolic sizes


@pytest.mark.parametrize("mode,tokens,hidden,d,dtype,golden", [
    ("sp", 64, 32, 2, DataType.BFloat16, MLP_SP_2),
    ("tp", 16, 8, 4, DataType.Float, MLP_TP_4),
])
def test_tp_mlp_golden(mode, tokens, hidden, d, dtype, golden):
    fd = _tp_mlp_module().define_mlp(tokens, hidden, d, mode, dtype)
    assert str(fd) == golden


def test_api_md_mlp_golden():
    """The API.md example, written out here (no bias on the second linear, symbolic tokens)."""
    d = 2
    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 8], dtype=DataType.BFloat16)
        w1 = fd.define_tensor([32, 8], dtype=DataType.BFloat16)
        b1 = fd.define_tensor([32], dtype=DataType.BFloat16)
        w2 = fd.define_tensor([8, 32], dtype=DataType.BFloat16)
        y = fd.ops.gelu(fd.ops.linear(x, w1, b1), approximate="tanh")
        z = fd.ops.linear(y, w2)
        fd.add_output(z)
        for tv in (x, w1, b1, w2, z):
            tv.set_device_mesh(mesh)
        for tv in (w1, b1):
            tv.outer_split(0, d)
            tv.axis(0).parallelize(ParallelType.mesh_x)
        w2.outer_split(1, d)
        w2.axis(1).parallelize(ParallelType.DIDx)
    assert str(fd) == """\
Fusion(inputs=[T0, T1, T2, T3], outputs=[T6])
  T0 = input : bf16[?, 8] @mesh(0 1)[?, 8]
  T1 = input : bf16[32, 8] @mesh(0 1)[mesh_x{2}, 16, 8]
  T2 = input : bf16[32] @mesh(0 1)[mesh_x{2}, 16]
  T3 = input : bf16[8, 32] @mesh(0 1)[8, mesh_x{2}, 16]
  T4 = linear(T0, T1, T2) : bf16[?, 32]
  T5 = gelu(T4, approximate='tanh') : bf16[?, 32]
  T6 = linear(T5, T3) : bf16[?, 8] @mesh(0 1)[?, 8, r{32}]"""


def _mesh_2d_fusion() -> FusionDefinition:
    mesh = DeviceMesh(torch.arange(4).reshape(2, 2))
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 8], dtype=DataType.BFloat16)
        w = fd.define_tensor([16, 8], dtype=DataType.BFloat16)
        y = fd.ops.linear(x, w)
        fd.add_output(y)
        x.set_device_mesh(mesh)
        x.outer_split(0, 2)
        x.axis(0).parallelize(ParallelType.mesh_y)
        w.set_device_mesh(mesh)
        w.outer_split(0, 2)
        w.axis(0).parallelize(ParallelType.DIDx)
        w.split(2, 4)  # a serial inner split prints its pieces
        y.set_device_mesh(mesh)
    return fd


def test_2d_mesh_golden():
    assert str(_mesh_2d_fusion()) == MESH_2D


def test_type_and_sharding_strings():
    fd = _mesh_2d_fusion()
    tensors = fd.fusion.tensors
    assert tensors[0].type_str() == "bf16[?, 8]"
    assert tensors[0].sharding_str() == " @mesh(2x2: 0 1 2 3)[mesh_y{2}, ?, 8]"
    assert str(LoopAxis(0, 2, ParallelType.mesh_x)) == "mesh_x{2}"
    assert str(LoopAxis(0, -1)) == "?"
    assert str(LoopAxis(1, 5)) == "5"


def test_handles_repr():
    mesh = DeviceMesh(range(2))
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6])
        x.set_device_mesh(mesh)
        x.outer_split(1, 2)
        x.axis(1).parallelize(ParallelType.mesh_x)
    assert repr(x) == "TensorView(T0: f32[4, 6] @mesh(0 1)[4, mesh_x{2}, 3])"
    assert repr(x.axis(1)) == "IterDomain(mesh_x{2})"
    assert x.axis(1).extent == 2 and x.axis(1).parallel_type is ParallelType.mesh_x
    assert x.axis(2).extent == 3 and x.axis(2).parallel_type is ParallelType.serial
    assert repr(mesh) == "DeviceMesh([0, 1])"
    assert repr(DeviceMesh(torch.arange(4).reshape(2, 2))) == "DeviceMesh([0, 1, 2, 3], shape=[2, 2])"


def test_plan_repr_is_one_line():
    """What a REPL shows for fd.plan (was the dataclass dump of the whole program, 2.8 KB); str is the listing."""
    mesh = DeviceMesh(range(2))
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([8, 4]), fd.define_tensor([6, 4])
        y = fd.ops.linear(x, w)
        fd.add_output(y)
        for tv in (x, w, y):
            tv.set_device_mesh(mesh)
        x.outer_split(0, 2).axis(0).parallelize(ParallelType.mesh_x)
    plan = fd.compile([[8, 4], [6, 4]], rank=1)
    assert repr(plan) == "<Plan: 2 segments on rank 1 (cpu), collectives ['allgather']>"
    assert str(plan).startswith("Plan: 2 segment(s); inputs [T0, T1], outputs [T2]\n  segment 0: compute\n")
    assert repr(_small_fusion().compile([[3, 8], [8], [3, 8]])).startswith("<Plan: 1 segment on rank 0 (cpu), ")


@pytest.mark.parametrize("build", [_small_fusion, _mesh_2d_fusion,
                                   lambda: _tp_mlp_module().define_mlp(64, 32, 2, "sp", DataType.BFloat16)])
def test_printing_is_deterministic(build):
    fd = build()
    first = str(fd)
    assert str(fd) == first and str(fd.fusion) == first
    assert str(build()) == first  # an identical definition prints identically


# --- immutability ----------------------------------------------------------------------------

def test_ir_nodes_are_frozen():
    fd = _mesh_2d_fusion()
    fusion = fd.fusion
    t = fusion.tensors[0]
    op = fusion.ops[0]
    loop_axis = t.loop[0]
    for node, field, value in [(fusion, "tensors", ()), (fusion, "outputs", (0,)), (t, "shape", (1, 2)),
                               (t, "sharding", None), (op, "kind", "matmul"), (op, "inputs", (1, 0)),
                               (loop_axis, "extent", 4), (Const(1.0), "value", 2.0),
                               (Segment("compute", (0,)), "kind", "fused")]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(node, field, value)
    assert isinstance(fusion.tensors, tuple) and isinstance(fusion.ops, tuple)
    assert isinstance(t.shape, tuple) and isinstance(t.loop, tuple) and isinstance(op.attrs, tuple)
    for cls in (Fusion, Tensor, Op, LoopAxis, Const, Segment):
        assert dataclasses.fields(cls) and cls.__dataclass_params__.frozen, cls


def test_list_attributes_are_frozen_to_tuples():
    with FusionDefinition() as fd:
        x = fd.define_tensor([2, 3, 4])
        fd.add_output(fd.ops.permute(x, [2, 0, 1]))
        fd.add_output(fd.ops.reshape(x, [6, 4]))
    ops = fd.fusion.ops
    assert ops[0].attr("dims") == (2, 0, 1)
    assert ops[1].attr("shape") == (6, 4)
    hash(ops[0])  # hashable, so nothing mutable is inside


def test_snapshot_is_not_changed_by_later_schedule_calls():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6])
        fd.add_output(fd.ops.relu(x))
    before = fd.fusion
    text = str(before)
    x.set_device_mesh(DeviceMesh(range(2)))
    x.outer_split(0, 2)
    x.axis(0).parallelize(ParallelType.mesh_x)
    assert str(before) == text
    assert before.tensors[0].sharding is None and before.tensors[0].loop is None
    assert fd.fusion.tensors[0].sharding is not None
    assert str(fd) != text


def test_mesh_is_immutable():
    mesh = DeviceMesh(range(2))
    with pytest.raises(AttributeError):
        mesh.devices = (0,)
    assert mesh.devices == (0, 1)
