# Ported from NVIDIA/Fuser tests/python/multidevice/test_overlap.py
# (https://github.com/NVIDIA/Fuser, commit 81c4b22fd750d377d69e24928c32233162f6b2bd),
# BSD-3-Clause; the upstream copyright notice follows. Changed lines are marked `# tp_fusion:` and
# listed in docs/nvfuser.md.
# SPDX-FileCopyrightText: Copyright (c) 2024-present NVIDIA CORPORATION & AFFILIATES.
# All rights reserved.
# SPDX-License-Identifier: BSD-3-Clause

# tp_fusion: ParallelType.stream only schedules (it splits work over CUDA streams; the values are
# those of the serial schedule): tp_fusion accepts it as a serial loop. swizzle1d (a stream-index
# permutation, no effect on values), host IR options, MultiDeviceExecutor(params) and
# CommunicatorBackend are dropped; kernel and profiler counts become fd.plan.collectives();
# benchmarks run once, on small shapes, without timing. The plain torch references (*_reference*)
# have no fusion: not ported (docs/nvfuser.md lists each test).

import pytest

import torch

import tp_fusion as nvfuser  # tp_fusion: was nvfuser_direct
from tp_fusion import DataType, FusionDefinition, TensorView  # tp_fusion: was nvfuser_direct


@pytest.mark.mpi
def test_allgather_matmul_no_overlap(multidevice_test):  # tp_fusion: backend_type parameter dropped
    def fusion_definition(
        fd: FusionDefinition, m: int, k: int, n: int, d: int
    ) -> list[TensorView]:
        a = fd.define_tensor(
            shape=[d, m // d, k],
            contiguity=True,
            dtype=DataType.from_torch(dtype),  # tp_fusion: was torch_dtype_to_nvfuser_dtype(dtype)
        )
        b = fd.define_tensor(
            shape=[k, n],
            contiguity=True,
            dtype=DataType.from_torch(dtype),  # tp_fusion: was torch_dtype_to_nvfuser_dtype(dtype)
        )

        c = fd.ops.matmul(a, b)
        fd.add_output(c)
        return [a, b, c]

    def multidevice_schedule(tensors: list[TensorView], num_devices: int) -> None:
        mesh = nvfuser.multidevice.DeviceMesh(range(num_devices))
        for tv in tensors:
            tv.set_device_mesh(mesh)

        a, _, _ = tensors
        a.axis(0).parallelize(nvfuser.ParallelType.mesh_x)

    d = multidevice_test.size
    m, k, n = 128, 64, 96
    if m % d != 0:
        pytest.skip(f"m ({m}) must be divisible by world size ({d}).")

    dtype = torch.bfloat16
    with FusionDefinition() as fd:
        tensors = fusion_definition(fd, m, k, n, d)
        multidevice_schedule(tensors, d)

    a_ref = torch.testing.make_tensor(d, m // d, k, dtype=torch.int32, device="cpu").to(
        dtype
    )
    b_ref = torch.testing.make_tensor(k, n, dtype=torch.int32, device="cpu").to(dtype)

    a = multidevice_test.shard_tensor(a_ref, fd.fusion.inputs()[0])
    b = b_ref.to(a.device)  # tp_fusion: was b_ref.cuda(multidevice_test.local_rank)

    (out,) = fd.execute([a, b])  # tp_fusion: was MultiDeviceExecutor(fd.fusion, params).run([a, b])
    out_ref = torch.matmul(a_ref, b_ref)
    torch.testing.assert_close(out.cpu(), out_ref)


def row_parallel_linear_forward(
    h: int, num_devices: int, num_chunks: int
) -> FusionDefinition:
    with FusionDefinition() as fd:
        inp = fd.define_tensor(
            shape=[-1, h * 4], contiguity=True, dtype=DataType.BFloat16
        )
        weight = fd.define_tensor(
            shape=[h, h * 4], contiguity=True, dtype=DataType.BFloat16
        )
        out = fd.ops.linear(inp, weight)
        fd.add_output(out)

        mesh = nvfuser.multidevice.DeviceMesh(torch.arange(num_devices))
        for tv in (inp, weight):
            tv.set_device_mesh(mesh)

        inp.outer_split(0, num_chunks)
        inp.axis(0).parallelize(nvfuser.ParallelType.stream)
        inp.outer_split(2, mesh.size)
        inp.axis(2).parallelize(nvfuser.ParallelType.mesh_x)
        weight.outer_split(1, mesh.size)
        weight.axis(1).parallelize(nvfuser.ParallelType.mesh_x)

    return fd


@pytest.mark.mpi
def test_row_parallel_linear_forward(multidevice_test):
    # This is a port of CollectiveBasedOverlapTest.RowParallelLinear_Forward.
    h, s, t = 2, 3, 6
    d = multidevice_test.size
    if (h * 4) % d != 0:
        pytest.skip(
            f"Row-parallel linear requires {h * 4} to be divisible by world size {d}."
        )
    assert t % s == 0

    fd = row_parallel_linear_forward(h, d, s)

    inp_ref = torch.testing.make_tensor(t, h * 4, dtype=torch.int32, device="cpu").to(
        torch.bfloat16
    )
    weight_ref = torch.testing.make_tensor(
        h, h * 4, dtype=torch.int32, device="cpu"
    ).to(torch.bfloat16)
    out_ref = torch.nn.functional.linear(inp_ref, weight_ref)

    inp = multidevice_test.shard_tensor(inp_ref, fd.fusion.inputs()[0])
    weight = multidevice_test.shard_tensor(weight_ref, fd.fusion.inputs()[1])
    (out,) = fd.execute([inp, weight])  # tp_fusion: host IR options and torch.profiler dropped
    torch.testing.assert_close(out.cpu(), out_ref)

    # tp_fusion: was `len(aten::mm events) == s` with shapes [[t/s, 4h/d], [4h/d, h], [t/s, h]] (one
    # matmul and allreduce per stream); tp_fusion runs the serial schedule: one allreduce.
    assert fd.plan.collectives() == (["allreduce"] if d > 1 else [])


@pytest.mark.mpi
@pytest.mark.parametrize("s", [1, 2, 4])
def test_row_parallel_linear_forward_benchmark(multidevice_test, s):  # tp_fusion: no benchmark
    # This is a port of CollectiveBasedOverlapTest.RowParallelLinear_Forward.
    h, t = 64, 64  # tp_fusion: were 8192, 8192 (small shapes for CPU ranks)
    d = multidevice_test.size
    if (h * 4) % d != 0:
        pytest.skip(
            f"Row-parallel linear requires {h * 4} to be divisible by world size {d}."
        )
    assert t % s == 0

    fd = row_parallel_linear_forward(h, d, s)

    inp_ref = torch.randn(t, h * 4, dtype=torch.bfloat16, device="cpu")
    weight_ref = torch.randn(h, h * 4, dtype=torch.bfloat16, device="cpu")

    inp = multidevice_test.shard_tensor(inp_ref, fd.fusion.inputs()[0])
    weight = multidevice_test.shard_tensor(weight_ref, fd.fusion.inputs()[1])

    (out,) = fd.execute([inp, weight])  # tp_fusion: was get_benchmark_fns + benchmark.pedantic
    # tp_fusion: added (upstream asserts nothing): shape, dtype, and values within bf16 rounding of
    # a sum of d partial products.
    assert out.shape == (t, h) and out.dtype == torch.bfloat16
    out_ref = torch.nn.functional.linear(inp_ref.float(), weight_ref.float())
    torch.testing.assert_close(out.cpu().float(), out_ref, rtol=2e-2, atol=0.5)


def column_parallel_linear_forward(h: int, d: int, parallelism: str):
    with FusionDefinition() as fd:
        inp_tv = fd.define_tensor((-1, h), contiguity=True, dtype=DataType.BFloat16)
        weight_tv = fd.define_tensor(
            (4 * h, h), contiguity=True, dtype=DataType.BFloat16
        )
        ag_out = fd.ops.set(inp_tv)
        out_tv = fd.ops.linear(ag_out, weight_tv)
        fd.add_output(out_tv)

        mesh = nvfuser.multidevice.DeviceMesh(torch.arange(d))

        for tv in [inp_tv, weight_tv]:
            tv.set_device_mesh(mesh)
            tv.outer_split(0, d)
            tv.axis(0).parallelize(nvfuser.ParallelType.mesh_x)

        ag_out.set_device_mesh(mesh)
        ag_out.outer_split(0, d)
        # tp_fusion: `if parallelism == "collective_permute": ag_out.swizzle1d(0, mesh_x)` dropped
        # (a permutation of the stream loop: the order of the chunks' transfers, not their values)
        ag_out.axis(0).parallelize(nvfuser.ParallelType.stream)

    return fd


@pytest.mark.mpi
@pytest.mark.parametrize("parallelism", ["collective_permute", "broadcast"])
def test_column_parallel_linear_forward(multidevice_test, parallelism: str):
    # This is a port of CollectiveBasedOverlapTest.ColumnAndSequenceParallelLinear_Forward.
    # The difference is we are using broadcast based overlapping instead of send/recv.
    h, t = 2, 24
    d = multidevice_test.size
    if (h * 4) % d != 0:
        pytest.skip(
            f"Column-parallel linear requires {h * 4} to be divisible by world size {d}."
        )
    if t % d != 0:
        pytest.skip(
            f"Column-parallel linear requires {t} to be divisible by world size {d}."
        )

    fd = column_parallel_linear_forward(h, d, parallelism)

    inp_ref = torch.testing.make_tensor(t, h, dtype=torch.int32, device="cpu").to(
        torch.bfloat16
    )
    weight_ref = torch.testing.make_tensor(
        4 * h, h, dtype=torch.int32, device="cpu"
    ).to(torch.bfloat16)

    inp = multidevice_test.shard_tensor(inp_ref, fd.fusion.inputs()[0])
    weight = multidevice_test.shard_tensor(weight_ref, fd.fusion.inputs()[1])

    out_ref = torch.nn.functional.linear(inp_ref.to(weight.device), weight)  # tp_fusion: was .cuda()

    (out,) = fd.execute([inp, weight])  # tp_fusion: host IR option and torch.profiler dropped
    torch.testing.assert_close(out, out_ref)

    # tp_fusion: was d-1 ncclDevKernel_SendRecv (collective_permute) or d ncclDevKernel_Broadcast
    # (broadcast) kernels: nvFuser's stream decomposition of the allgather that `set` asks for.
    assert fd.plan.collectives() == (["allgather"] if d > 1 else [])


@pytest.mark.mpi
@pytest.mark.parametrize("parallelism", ["collective_permute", "broadcast"])
def test_column_parallel_linear_forward_benchmark(
    multidevice_test, parallelism: str
):  # tp_fusion: no benchmark
    # This is a port of CollectiveBasedOverlapTest.ColumnParallelLinear_Forward.
    h, t = 64, 64  # tp_fusion: were 8192, 8192 (small shapes for CPU ranks)
    d = multidevice_test.size
    if (4 * h) % d != 0:
        pytest.skip(
            f"Column-parallel linear requires {4 * h} to be divisible by world size {d}."
        )
    if t % d != 0:
        pytest.skip(
            f"Column-parallel linear requires {t} to be divisible by world size {d}."
        )

    fd = column_parallel_linear_forward(h, d, parallelism)

    inp_ref = torch.randn(t, h, dtype=torch.bfloat16, device="cpu")
    weight_ref = torch.randn(4 * h, h, dtype=torch.bfloat16, device="cpu")

    inp = multidevice_test.shard_tensor(inp_ref, fd.fusion.inputs()[0])
    weight = multidevice_test.shard_tensor(weight_ref, fd.fusion.inputs()[1])

    (out,) = fd.execute([inp, weight])  # tp_fusion: was get_benchmark_fns + benchmark.pedantic
    # tp_fusion: added (upstream asserts nothing)
    torch.testing.assert_close(out, torch.nn.functional.linear(inp_ref.to(weight.device), weight))


@pytest.mark.mpi
@pytest.mark.parametrize("s", [1, 8])  # tp_fusion: backend_type parameter (nccl only) dropped
def test_overlap_allgather_matmul_stream_outermost(multidevice_test, s):  # tp_fusion: no benchmark
    def fusion_definition(fd, m, k, n, s, d) -> list[TensorView]:
        x = fd.define_tensor(
            shape=[s, d, m // (s * d), k], contiguity=True, dtype=DataType.BFloat16
        )
        weight = fd.define_tensor(
            shape=[n, k], contiguity=True, dtype=DataType.BFloat16
        )
        bias = fd.define_tensor(shape=[n], contiguity=True, dtype=DataType.BFloat16)

        # [s, d, m//(s*d), n]
        out = fd.ops.linear(x, weight, bias)

        fd.add_output(out)
        return [x, weight, bias, out]

    def multidevice_schedule(fd, tensors, num_devices) -> None:
        mesh = nvfuser.multidevice.DeviceMesh(range(num_devices))
        for tv in tensors:
            tv.set_device_mesh(mesh)

        x, weight, bias, out = tensors
        x.axis(1).parallelize(nvfuser.ParallelType.mesh_x)
        out.axis(0).parallelize(nvfuser.ParallelType.stream)

    N_WARMUPS = 2  # tp_fusion: was N_WARMUPS, N_ITERATIONS = 5, 25
    m, k, n, d = 2**7, 2**7, 2**7, multidevice_test.size  # tp_fusion: were 2**10 (CPU ranks)
    assert m % (s * d) == 0

    x_unsharded = torch.testing.make_tensor(
        s, d, m // (s * d), k, dtype=torch.bfloat16, device="cpu"
    )
    x = multidevice_test.shard_tensor_1d(
        x_unsharded,
        1,
        nvfuser.multidevice.DeviceMesh(range(multidevice_test.size)),
    )
    weight = torch.testing.make_tensor(n, k, dtype=torch.bfloat16, device=x.device)  # tp_fusion: "cuda"
    bias = torch.testing.make_tensor(n, dtype=torch.bfloat16, device=x.device)  # tp_fusion: was "cuda"
    ins = [x, weight, bias]
    out_ref = torch.nn.functional.linear(x_unsharded, weight.cpu(), bias.cpu())

    with FusionDefinition() as fd:
        tensors = fusion_definition(fd, m, k, n, s, d)
        multidevice_schedule(fd, tensors, d)

    # warmup
    for _ in range(N_WARMUPS):
        outputs = fd.execute(ins)  # tp_fusion: was MultiDeviceExecutor(fd.fusion, params).run(ins)
        out = outputs[0].cpu()
        assert out.dtype == torch.bfloat16
        assert out.shape == torch.Size([s, d, m // (s * d), n])
        torch.testing.assert_close(out, out_ref, rtol=1e-1, atol=1e-1)
    # tp_fusion: added: out is replicated on the mesh, x sharded: one allgather
    assert fd.plan.collectives() == (["allgather"] if d > 1 else [])


@pytest.mark.mpi
def test_overlap_allgather_matmul_shard_outermost(multidevice_test):
    # tp_fusion: backend_type parameter [nccl, cuda] and benchmark dropped
    def fusion_definition(fd, m, k, n, d) -> list[TensorView]:
        x = fd.define_tensor(
            shape=[d, m // d, k], contiguity=True, dtype=DataType.BFloat16
        )
        weight = fd.define_tensor(
            shape=[n, k], contiguity=True, dtype=DataType.BFloat16
        )
        bias = fd.define_tensor(shape=[n], contiguity=True, dtype=DataType.BFloat16)

        # [d, m//d, n]
        out = fd.ops.linear(x, weight, bias)

        fd.add_output(out)
        return [x, weight, bias, out]

    def multidevice_schedule(fd, tensors, num_devices) -> None:
        mesh = nvfuser.multidevice.DeviceMesh(range(num_devices))
        for tv in tensors:
            tv.set_device_mesh(mesh)

        x, weight, bias, out = tensors
        x.axis(0).parallelize(nvfuser.ParallelType.mesh_x)
        out.axis(0).parallelize(nvfuser.ParallelType.stream)

    N_WARMUPS = 2  # tp_fusion: was N_WARMUPS, N_ITERATIONS = 5, 25
    m, k, n, d = 2**7, 2**7, 2**7, multidevice_test.size  # tp_fusion: were 2**10 (CPU ranks)
    assert m % d == 0

    x_unsharded = torch.testing.make_tensor(
        d, m // d, k, dtype=torch.bfloat16, device="cpu"
    )
    x = multidevice_test.shard_tensor_1d(
        x_unsharded,
        0,
        nvfuser.multidevice.DeviceMesh(range(multidevice_test.size)),
    )
    weight = torch.testing.make_tensor(n, k, dtype=torch.bfloat16, device=x.device)  # tp_fusion: "cuda"
    bias = torch.testing.make_tensor(n, dtype=torch.bfloat16, device=x.device)  # tp_fusion: was "cuda"
    ins = [x, weight, bias]
    out_ref = torch.nn.functional.linear(x_unsharded, weight.cpu(), bias.cpu())

    with FusionDefinition() as fd:
        tensors = fusion_definition(fd, m, k, n, d)
        multidevice_schedule(fd, tensors, d)

    # tp_fusion: params.use_allocation_cache / offset_stream_indexing_by_rank dropped
    # warmup
    for _ in range(N_WARMUPS):
        outputs = fd.execute(ins)  # tp_fusion: was MultiDeviceExecutor(fd.fusion, params).run(ins)
        out = outputs[0].cpu()
        assert out.dtype == torch.bfloat16
        assert out.shape == torch.Size([d, m // d, n])
        torch.testing.assert_close(out, out_ref, rtol=1e-1, atol=1e-1)
    # tp_fusion: added
    assert fd.plan.collectives() == (["allgather"] if d > 1 else [])
