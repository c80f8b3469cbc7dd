"""Issue 12 (reliability) on gloo ranks: inputs that require grad, the rank that failed first named
by every rank, retry after a failure, fusions mixed up across ranks, re-initialized process
groups, KeyboardInterrupt in a segment, the store's timeout, empty contractions, and strategies
that lowering can serve.

Most tests take the batched ``multidevice_test`` ranks; the fault tests (which abort the process
group) spawn their own, one world-4 run for all of them.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time

import pytest
import torch
import torch.nn.functional as F
from conftest import rand, shard
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tp_fusion import (
    DataType,
    DefinitionError,
    DeviceMesh,
    ExecutionError,
    FusionDefinition,
    InputError,
    ParallelType,
    TPFusionError,
    shard_tensor,
)
from tp_fusion import ops as _ops
from tp_fusion.launch import run_on_ranks
from tp_fusion.runtime import dist

X, Y = ParallelType.mesh_x, ParallelType.mesh_y
PG_TIMEOUT_S = 60.0
BOUND_S = 20.0


# --- item 1: execute is forward only ------------------------------------------------------------


def _mlp(d: int, sequence_parallel: bool):
    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        x = fd.define_tensor([4 * d, 8])
        w1 = fd.define_tensor([4 * d, 8])
        b1 = fd.define_tensor([4 * d])
        w2 = fd.define_tensor([8, 4 * d])
        z = fd.ops.linear(fd.ops.gelu(fd.ops.linear(x, w1, b1), approximate="tanh"), w2)
        fd.add_output(z)
        for tv in (x, w1, b1, w2, z):
            tv.set_device_mesh(mesh)
        for tv in (w1, b1):
            tv.outer_split(0, d)
            tv.axis(0).parallelize(X)
        w2.outer_split(1, d)
        w2.axis(1).parallelize(X)
        if sequence_parallel:
            for tv in (x, z):
                tv.outer_split(0, d)
                tv.axis(0).parallelize(X)
    return fd, (x, w1, b1, w2, z)


@pytest.mark.ranks(2)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp_mlp", "sp_mlp"])
def test_mlp_with_parameters_and_requires_grad(multidevice_test, sequence_parallel):
    d = multidevice_test.size
    fd, tvs = _mlp(d, sequence_parallel)
    full = [rand(1, 4 * d, 8, dtype=torch.float32), rand(2, 4 * d, 8, dtype=torch.float32),
            rand(3, 4 * d, dtype=torch.float32), rand(4, 8, 4 * d, dtype=torch.float32)]
    want = F.linear(F.gelu(F.linear(full[0], full[1], full[2]), approximate="tanh"), full[3])
    shards = [multidevice_test.shard_tensor(t, tv) for t, tv in zip(full, tvs)]
    inputs = [shards[0].clone().requires_grad_()] + [torch.nn.Parameter(s.clone()) for s in shards[1:]]
    for _ in range(2):  # the first call compiles, the second hits the cache
        (out,) = fd.execute(inputs)
        assert not out.requires_grad and out.grad_fn is None
        torch.testing.assert_close(out, multidevice_test.shard_tensor(want, tvs[4]), rtol=1e-4, atol=1e-4)
    assert any(seg.fused is not None for seg in fd.plan.segments), str(fd.plan)  # fused segments ran
    for got, s in zip(inputs, shards):
        assert torch.equal(got.detach(), s) and got.grad is None


@pytest.mark.ranks(2)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp_mlp", "sp_mlp"])
def test_mlp_in_and_out_of_inference_mode_and_autocast(multidevice_test, sequence_parallel):
    """An evaluation pass under inference_mode first, then normal calls, then calls under autocast: each runs the
    dtypes the fusion declares, and the buffers the first call cached (the fused kernels' mailboxes) serve the
    later ones. Before, the second call failed (inference tensors written outside inference mode) and autocast
    made the fused GEMM meet a bf16 activation with an f32 weight."""
    d = multidevice_test.size
    fd, tvs = _mlp(d, sequence_parallel)
    full = [rand(1, 4 * d, 8, dtype=torch.float32), rand(2, 4 * d, 8, dtype=torch.float32),
            rand(3, 4 * d, dtype=torch.float32), rand(4, 8, 4 * d, dtype=torch.float32)]
    want = multidevice_test.shard_tensor(
        F.linear(F.gelu(F.linear(full[0], full[1], full[2]), approximate="tanh"), full[3]), tvs[4])
    shards = [multidevice_test.shard_tensor(t, tv) for t, tv in zip(full, tvs)]
    with torch.inference_mode():
        (out,) = fd.execute(shards)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    (out,) = fd.execute(shards)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (out,) = fd.execute(shards)
    assert out.dtype is torch.float32
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    assert any(seg.fused is not None for seg in fd.plan.segments), str(fd.plan)  # fused segments ran


def _grad_case(seed: int, mesh: DeviceMesh, grads: list[bool]):
    """x [r, k] @ w^T [k, n] + b, relu, times y: each of x, w, b, y possibly requiring grad; random
    shardings on mesh_x (and mesh_y on a 2-D mesh); returns (fd, tvs, full inputs, reference)."""
    rng = random.Random(seed)
    mx = mesh.shape[-1]
    my = mesh.shape[0] if mesh.ndim == 2 else 1
    r, k, n = 2 * mx * my, 2 * mx * my, 2 * mx * my
    full = [rand(seed, r, k), rand(seed + 1, n, k), rand(seed + 2, n), rand(seed + 3, r, n)]
    with FusionDefinition() as fd:
        tvs = [fd.define_tensor(list(t.shape), dtype=DataType.Double) for t in full]
        x, w, b, y = tvs
        h = fd.ops.relu(fd.ops.linear(x, w, b))
        out = fd.ops.mul(h, y)
        fd.add_output(out)
        for tv in (*tvs, out):
            dims = {}
            for ptype in ((X, Y) if mesh.ndim == 2 else (X,)):
                if rng.random() < 0.5:
                    free = [dd for dd in range(len(tv.shape)) if dd not in dims]
                    if free:
                        dims[rng.choice(free)] = ptype
            shard(tv, mesh, dims)
    want = torch.relu(F.linear(full[0], full[1], full[2])) * full[3]
    inputs = [t.clone().requires_grad_(g) for t, g in zip(full, grads)]
    return fd, tvs, inputs, out, want


@pytest.mark.ranks(2, 4)
@settings(max_examples=4, deadline=None, derandomize=True, database=None, phases=(Phase.generate,),
          suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000), grads=st.lists(st.booleans(), min_size=4, max_size=4),
       two_d=st.booleans())
def test_property_requires_grad_mix(multidevice_test, seed, grads, two_d):
    size = multidevice_test.size
    if two_d and size != 4:
        two_d = False
    mesh = DeviceMesh(torch.arange(size).reshape(2, 2)) if two_d else DeviceMesh(range(size))
    fd, tvs, inputs, out_tv, want = _grad_case(seed, mesh, grads)
    local = [multidevice_test.shard_tensor(t.detach(), tv).requires_grad_(t.requires_grad)
             for t, tv in zip(inputs, tvs)]
    try:
        (out,) = fd.execute(local)
        outcome = ("ok", None)
    except TPFusionError as e:
        outcome, out = ("error", type(e).__name__), None
    outcomes = dist.gather_from_all(outcome)
    assert all(o == outcomes[0] for o in outcomes), (seed, grads, outcomes)
    if out is not None:
        assert not out.requires_grad
        (sharding,) = fd.output_shardings()
        torch.testing.assert_close(out, multidevice_test.shard_tensor(want.detach(), sharding))


# --- item 4: two identical fusions executed in opposite orders -----------------------------------


@pytest.mark.ranks(2)
def test_identical_fusions_in_opposite_orders(multidevice_test):
    d, rank = multidevice_test.size, multidevice_test.rank
    mesh = DeviceMesh(range(d))

    def make():
        with FusionDefinition() as fd:
            x = fd.define_tensor([2 * d, 3])
            y = fd.ops.set(fd.ops.relu(x))
            fd.add_output(y)
            shard(x, mesh, {0: X})
            shard(y, mesh)
        return fd, x
    (fa, xa), (fb, _) = make(), make()
    full = rand(5, 2 * d, 3, dtype=torch.float32).to(multidevice_test.device)
    inp = [multidevice_test.shard_tensor(full, xa)]
    order = (fa, fb) if rank == 0 else (fb, fa)
    for fd in order:
        with pytest.raises(DefinitionError, match=r"executed another fusion than rank \d did"):
            fd.execute(inp)
    # In the same order on every rank, both run.
    for fd in (fa, fb):
        (out,) = fd.execute(inp)
        torch.testing.assert_close(out, torch.relu(full))


@pytest.mark.ranks(2)
def test_lagged_agreement_raises_on_every_rank_a_batch_later(multidevice_test):
    """Under NCCL calls are checked in batches by an asynchronous host-side all_reduce read a batch
    later; the same mechanism, driven directly (batches of 2 calls)."""
    from tp_fusion.runtime.faults import LaggedAgreement

    check, world = LaggedAgreement(batch=2), dist.world_token()
    for fp in (7, 8, 7, 8):  # batches 1-2 and 3-4 agree
        check.check_and_launch(world, fp)
    check.check_and_launch(world, 9)
    check.check_and_launch(world, 10 + multidevice_test.rank)  # calls 5-6: the ranks differ
    check.check_and_launch(world, 7)
    with pytest.raises(DefinitionError, match=r"executed different fusions .* calls 5-6 .*\(up to 3 calls ago"):
        check.check_and_launch(world, 7)  # the end of calls 7-8 reads calls 5-6


# --- items 10, 11: an empty contraction; strategies lowering can serve ---------------------------


@pytest.mark.ranks(2, 4)
@pytest.mark.parametrize("rows,bias,residual", [(0, False, False), (0, True, False), (4, False, False),
                                                (0, True, True), (4, True, True)])
def test_zero_row_contraction_over_sharded_dim(multidevice_test, rows, bias, residual):
    """A row-parallel linear (its fused GEMM+allreduce taking the bias and residual adds after it) on
    rows that may be empty."""
    d = multidevice_test.size
    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        x = fd.define_tensor([rows, 2 * d])
        w = fd.define_tensor([3, 2 * d])
        b = fd.define_tensor([3]) if bias else None
        r = fd.define_tensor([rows, 3]) if residual else None
        y = fd.ops.linear(x, w, b)
        fd.add_output(fd.ops.add(r, y) if residual else y)
        shard(x, mesh, {1: X})
        shard(w, mesh, {1: X})
        for tv in (b, r):
            if tv is not None:
                shard(tv, mesh)
    f32 = torch.float32
    full = [rand(6, rows, 2 * d, dtype=f32), rand(7, 3, 2 * d, dtype=f32), rand(8, 3, dtype=f32) if bias else None,
            rand(9, rows, 3, dtype=f32) if residual else None]
    tvs = [x, w, b, r]
    (out,) = fd.execute([shard_tensor(t, tv, multidevice_test.rank) for t, tv in zip(full, tvs) if t is not None])
    want = F.linear(*full[:3])
    torch.testing.assert_close(out, want + full[3] if residual else want)
    if residual:
        assert [seg.note for seg in fd.plan.segments] == ["linear+allreduce+add+add"]


@pytest.mark.ranks(2)
def test_matmul_sub_strategy_is_lowerable(multidevice_test):
    d = multidevice_test.size
    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        p = fd.define_tensor([4, 2 * d])
        q = fd.define_tensor([2 * d, 3])
        b = fd.define_tensor([4, 3])
        c = fd.ops.sub(fd.ops.matmul(p, q), b)
        fd.add_output(c)
        shard(p, mesh, {1: X})
        shard(q, mesh, {0: X})
        shard(b, mesh, {0: X})
        shard(c, mesh, {0: X})
    f32 = torch.float32
    full = [rand(9, 4, 2 * d, dtype=f32), rand(10, 2 * d, 3, dtype=f32), rand(11, 4, 3, dtype=f32)]
    (out,) = fd.execute([shard_tensor(t, tv, multidevice_test.rank) for t, tv in zip(full, [p, q, b])])
    torch.testing.assert_close(out, shard_tensor(full[0] @ full[1] - full[2], c, multidevice_test.rank))


# --- items 2, 3, 5, 6, 7: faults, retry, re-init (spawned ranks: they abort the group) -----------


def _fusion(mesh: DeviceMesh, seed: int):
    """relu on row shards (segment 0) -> allgather along mesh_x (segment 1) -> tanh."""
    rows = 2 * mesh.size
    with FusionDefinition() as fd:
        x = fd.define_tensor([rows, 3])
        a = fd.ops.relu(x)
        c = fd.ops.tanh(fd.ops.set(a))
        fd.add_output(c)
        for tv in (x, a):
            shard(tv, mesh, {0: X})
        shard(c, mesh)
    full = rand(seed, rows, 3, dtype=torch.float32)
    return fd, [shard_tensor(full, x)], torch.tanh(torch.relu(full))


def _fusion_1d(world: int):
    return _fusion(DeviceMesh(range(world)), 13)


def _fusion_2d(world: int):
    """The allgather runs over mesh_x sub-groups."""
    return _fusion(DeviceMesh(torch.arange(world).reshape(2, world // 2)), 12)


def _inject_op(kind: str, fail_rank: int, exc: BaseException, calls: list):
    original = _ops.OPS[kind]

    def impl(*args, **kwargs):
        calls.append(kind)
        if dist.rank() == fail_rank:
            raise exc
        return original.impl(*args, **kwargs)
    _ops.OPS[kind] = dataclasses.replace(original, impl=impl)
    return original


def _reinit(workdir: str, rank: int, world: int, name: str) -> None:
    dist.init_process_group("gloo", rank, world, f"file://{os.path.join(workdir, name)}", PG_TIMEOUT_S)


def _faults_and_retry(rank: int, world: int, workdir: str) -> None:
    os.environ["TP_FUSION_FAULT_GRACE_S"] = "1.5"
    fd, inputs, want = _fusion_1d(world)
    (out,) = fd.execute(inputs)
    torch.testing.assert_close(out, want)

    # Item 2: a RuntimeError raised by rank 2 only, inside the allgather, is named by every rank.
    real_all_gather = dist.all_gather

    def failing_all_gather(*args, **kwargs):
        if rank == 2:
            raise RuntimeError("injected allocation failure in all_gather")
        return real_all_gather(*args, **kwargs)
    dist.all_gather = failing_all_gather
    start = time.monotonic()
    try:
        with pytest.raises(ExecutionError) as info:
            fd.execute(inputs)
    finally:
        dist.all_gather = real_all_gather
    msg = str(info.value)
    assert time.monotonic() - start < BOUND_S, msg
    assert msg.startswith("rank 2 failed in segment 1 (communication): RuntimeError: injected allocation "
                          "failure in all_gather"), msg
    assert msg.endswith("; this rank's process group is destroyed (a failed plan tears it down, so that no peer "
                        "waits on it): initialize it again (torch.distributed.init_process_group) before the next "
                        "execute"), msg
    assert not dist.is_initialized()

    # Item 3: a retry without a process group raises before running any segment, saying why it is gone.
    calls: list = []
    original = _inject_op("relu", -1, RuntimeError("never"), calls)
    with pytest.raises(InputError, match=r"no torch.distributed process group is initialized: a plan that failed on "
                                         r"this rank earlier \(its ExecutionError\) destroyed it.*initialize it again"):
        fd.execute(inputs)
    assert calls == [], calls  # not half a plan: segment 0 did not run
    _ops.OPS["relu"] = original
    # ... and once the group is back, the retry runs the whole plan.
    _reinit(workdir, rank, world, "retry")
    (out,) = fd.execute(inputs)
    torch.testing.assert_close(out, want)

    # Item 5: destroy + re-init + execute a plan with sub-groups, twice.
    fd2, inputs2, want2 = _fusion_2d(world)
    for name in ("reinit1", "reinit2"):
        (out,) = fd2.execute(inputs2)
        torch.testing.assert_close(out, want2)
        dist.destroy_process_group()
        # destroyed by its owner, not by a failure: the plain hint
        with pytest.raises(InputError, match=r"no torch.distributed process group is initialized; under torchrun"):
            fd2.execute(inputs2)
        _reinit(workdir, rank, world, name)
    (out,) = fd2.execute(inputs2)
    torch.testing.assert_close(out, want2)


    # Item 6: a KeyboardInterrupt on rank 1 in segment 0 is reported to its peers, then re-raised.
    original = _inject_op("relu", 1, KeyboardInterrupt(), [])
    start = time.monotonic()
    if rank == 1:
        with pytest.raises(KeyboardInterrupt):
            fd.execute(inputs)
    else:
        with pytest.raises(ExecutionError) as info:
            fd.execute(inputs)
        msg = str(info.value)
        assert msg.startswith("rank 1 failed in segment 0 (compute): KeyboardInterrupt"), msg
    assert time.monotonic() - start < BOUND_S
    _ops.OPS["relu"] = original

    # Item 7: a failure report leaves the store's timeout as the user set it.
    from tp_fusion.runtime import faults

    _reinit(workdir, rank, world, "store")
    store = dist.default_store()
    before = store.timeout
    msg = faults.report_failure(rank, "a test", "RuntimeError: injected", local=True, grace_s=1.0)
    assert msg.startswith("rank "), msg
    assert store.timeout == before, (store.timeout, before)


def test_faults_retry_and_reinit(tmp_path):
    """Items 2, 3, 5, 6 and 7 in one world-4 run (each spawn costs seconds)."""
    start = time.monotonic()
    run_on_ranks(_faults_and_retry, 4, str(tmp_path), timeout_s=PG_TIMEOUT_S)
    assert time.monotonic() - start < PG_TIMEOUT_S
