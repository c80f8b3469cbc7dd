"""Bad schedules, meshes and inputs raise a clear TPFusionError on EVERY rank, before any
communication, and never leave a rank waiting. Each rank function runs many cases;
after each case the ranks run a small collective, so a rank left behind would show as a hang
(bounded by the process group's timeout) or as a wrong result.
"""

from __future__ import annotations

import re

import pytest
import torch

from tp_fusion import (
    DefinitionError,
    DeviceMesh,
    FusionDefinition,
    InputError,
    ParallelType,
    ShardingError,
    TPFusionError,
    shard_tensor,
)
from tp_fusion.runtime import dist


def _raises(cls, match, fn, *, base=ValueError):
    with pytest.raises(cls, match=match) as info:
        fn()
    assert isinstance(info.value, TPFusionError) and isinstance(info.value, base), repr(info.value)
    _in_step()
    return info.value


def _in_step() -> None:
    """Every rank reaches this point: a tiny collective that would hang if one had not."""
    t = torch.ones(1)
    dist.all_reduce(t, None)
    assert t.item() == dist.world_size()


def _sharded_relu(world: int, rows: int = -1, cols: int = 4):
    """x [rows, cols] sharded on dim 0 -> relu -> replicated output (an allgather)."""
    mesh = DeviceMesh(range(world))
    with FusionDefinition() as fd:
        x = fd.define_tensor([rows, cols])
        y = fd.ops.relu(x)
        fd.add_output(y)
        for tv in (x, y):
            tv.set_device_mesh(mesh)
        x.outer_split(0, world)
        x.axis(0).parallelize(ParallelType.mesh_x)
    return fd, x


def _schedule_errors(rank: int, world: int) -> None:
    mesh = DeviceMesh(range(world))
    fd = FusionDefinition()
    t = fd.define_tensor([5, 6])
    t.set_device_mesh(mesh)
    # A split that does not divide its extent.
    _raises(ShardingError, r"T0: split factor 2 does not divide loop axis 0 of extent 5 .*use a factor that "
                           r"divides 5", lambda: t.outer_split(0, world))
    # Axes out of range.
    _raises(ShardingError, r"T0.split: axis 2 is out of range for a loop domain of 2 axes \(tensor shape "
                           r"\[5, 6\]\)", lambda: t.split(2, 2))
    _raises(ShardingError, r"T0.axis: axis -3 is out of range", lambda: t.axis(-3))
    # A device parallel type used twice.
    t.outer_split(1, world)  # [5, 2, 3]
    t.axis(1).parallelize(ParallelType.mesh_x)
    t.split(0, 5)  # [1, 5, mesh_x{2}, 3]
    _raises(ShardingError, r"T0: mesh_x is already bound to loop axis 2; a device parallel type may be used "
                           "once per tensor", lambda: t.axis(0).parallelize(ParallelType.mesh_x))
    # Meshes with repeated devices, or empty.
    _raises(ShardingError, r"DeviceMesh \[0, 1, 0\] repeats device\(s\) \[0\]", lambda: DeviceMesh([0, 1, 0]))
    _raises(ShardingError, r"at least one device", lambda: DeviceMesh([]))
    # A device dim must have the mesh axis' extent (an inner piece may be one: a strided shard).
    fd2 = FusionDefinition()
    u = fd2.define_tensor([8, 6])
    u.set_device_mesh(mesh)
    u.split(0, world)  # [4, 2]
    _raises(ShardingError, r"extent 4 must equal the mesh axis size 2",
            lambda: u.axis(0).parallelize(ParallelType.mesh_x))


def _execute_errors(rank: int, world: int) -> None:
    g = torch.Generator().manual_seed(0)
    full = torch.randn(2 * world, 4, generator=g)
    fd, x = _sharded_relu(world, rows=2 * world)
    good = shard_tensor(full, x)

    # A mesh larger than the world.
    big = DeviceMesh(range(world + 1))
    with FusionDefinition() as fd_big:
        a = fd_big.define_tensor([world + 1, 3])
        fd_big.add_output(fd_big.ops.neg(a))
        a.set_device_mesh(big)
    err = _raises(ShardingError, re.escape(f"T0: DeviceMesh({list(range(world + 1))}) ({world + 1} devices) "
                                           f"names rank {world}, but the process group has {world} rank(s)"),
                  lambda: fd_big.execute([torch.ones(world + 1, 3)]))
    assert "start more ranks" in str(err)

    # A wrong number of inputs.
    _raises(InputError, r"execute: the fusion takes 1 inputs \(T0\), got 2", lambda: fd.execute([good, good]))

    # A bad local shape, dtype or device on EVERY rank.
    _raises(InputError, rf"input T0 dim 0 has local extent {2 * world}; its global extent {2 * world} split "
                        rf"{world} ways gives 2.*expected local shape \[2, 4\]", lambda: fd.execute([full]))
    _raises(InputError, r"input T0 has dtype torch.float64, the fusion defines it as torch.float32",
            lambda: fd.execute([good.double()]))
    _raises(InputError, r"input T0 is on meta with a gloo process group; use CUDA tensors with NCCL and CPU",
            lambda: fd.execute([torch.empty(2, 4, device="meta")]))

    # A good run fills the plan cache; then ONE rank passes a bad input: a cache hit on the others
    # must not run into the collective while that rank raises.
    (out,) = fd.execute([good])
    torch.testing.assert_close(out, torch.relu(full))
    for bad, want in ((good[:1], r"dim 0 has local extent 1"), (good.double(), r"has dtype torch.float64"),
                      (torch.empty(2, 4, device="meta"), r"input T0 is on meta")):
        mine = bad if rank == 1 else good
        err = _raises(InputError, want if rank == 1 else rf"rank 1 rejected its inputs: execute: .*{want}",
                      lambda mine=mine: fd.execute([mine]))
        assert "T0" in str(err)
    (out,) = fd.execute([good])  # a rejected input poisons nothing
    torch.testing.assert_close(out, torch.relu(full))

    # Symbolic extents: a sharded -1 dim whose shards disagree across ranks (only detectable by
    # comparing ranks: each rank's shard is self-consistent).
    fd_sym, xs = _sharded_relu(world)
    rows = 3 if rank == 1 else 2
    err = _raises(InputError, r"execute: the ranks' inputs imply different global shapes \(rank 0: T0 "
                              rf"\[{2 * world}, 4\]; rank 1: T0 \[{3 * world}, 4\]\); rank\(s\) \[1\] differ.*"
                              r"uneven pieces, as torch.tensor_split makes .* are not supported",
                  lambda: fd_sym.execute([torch.ones(rows, 4)]))
    (out,) = fd_sym.execute([good])
    torch.testing.assert_close(out, torch.relu(full))

    # A split of a symbolic extent that does not divide the size bound at execute.
    mesh = DeviceMesh(range(world))
    with FusionDefinition() as fd_div:
        s = fd_div.define_tensor([-1, 4])
        r = fd_div.ops.relu(s)
        fd_div.add_output(r)
        for tv in (s, r):
            tv.set_device_mesh(mesh)
        r.outer_split(0, world)
        r.axis(0).parallelize(ParallelType.mesh_x)
    _raises(ShardingError, rf"T1 f32\[\?, 4\]: dim 0 is symbolic and bound to {2 * world + 1} at execute, but "
                           rf"its schedule splits it by {world}, which does not divide {2 * world + 1}",
            lambda: fd_div.execute([torch.ones(2 * world + 1, 4)]))
    with FusionDefinition() as fd_ser:
        s = fd_ser.define_tensor([-1, 4])
        fd_ser.add_output(fd_ser.ops.neg(s))
        s.set_device_mesh(mesh)
        s.split(0, 3)  # serial: checked once the extent is known
    _raises(ShardingError, r"T0 f32\[\?, 4\]: dim 0 is symbolic and bound to 4 at execute, but its schedule "
                           r"splits it by 3, which does not divide 4",
            lambda: fd_ser.execute([torch.ones(4, 4)]))
    # ... and of a symbolic reduction axis (a linear's r{K}, sharded: a pending sum), as where K is defined
    with FusionDefinition() as fd_red:
        x, w = fd_red.define_tensor([4, -1]), fd_red.define_tensor([6, -1])
        y = fd_red.ops.linear(x, w)
        fd_red.add_output(y)
        for tv in (x, w, y):
            tv.set_device_mesh(mesh)
        y.outer_split(2, world)
        y.axis(2).parallelize(ParallelType.mesh_x)
    k = 2 * world + 1
    _raises(ShardingError, rf"T2 f32\[4, 6\]: dim r0 \(reduced\) is symbolic and bound to {k} at execute, but its "
                           rf"schedule splits it by {world}, which does not divide {k}",
            lambda: fd_red.execute([torch.ones(4, k), torch.ones(6, k)]))
    (out,) = fd_red.execute([torch.ones(4, 2 * world), torch.ones(6, 2 * world)])
    torch.testing.assert_close(out, torch.full((4, 6), 2.0 * world))

    # Ranks that build different fusions (e.g. a rank-dependent schedule).
    with FusionDefinition() as fd_div2:
        x2 = fd_div2.define_tensor([2 * world, 4])
        y2 = fd_div2.ops.relu(x2) if rank == 0 else fd_div2.ops.abs(x2)  # a different op on rank 1
        fd_div2.add_output(y2)
        for tv in (x2, y2):
            tv.set_device_mesh(mesh)
        x2.outer_split(0, world)
        x2.axis(0).parallelize(ParallelType.mesh_x)
    _raises(DefinitionError, r"execute: rank\(s\) \[1\] executed another fusion than rank 0 did",
            lambda: fd_div2.execute([good]))

    (out,) = fd.execute([good])
    torch.testing.assert_close(out, torch.relu(full))


@pytest.mark.ranks(2)
def test_schedule_errors_on_every_rank(multidevice_test):
    _schedule_errors(multidevice_test.rank, multidevice_test.size)


@pytest.mark.ranks(2)
def test_execute_errors_on_every_rank(multidevice_test):
    _execute_errors(multidevice_test.rank, multidevice_test.size)


def _cross_mesh(rank: int, world: int) -> None:
    """Operands on different meshes are reconciled by moving data (send_recv between meshes of one
    shape, broadcast otherwise); the result equals torch on every rank that holds it."""
    g = torch.Generator().manual_seed(1)
    xf, yf = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    cases = [
        (DeviceMesh([0, 1]), DeviceMesh([2, 3]), True),  # same shape: send_recv
        (DeviceMesh([0, 1]), DeviceMesh([0, 1, 2, 3]), False),  # different sizes: broadcast
        (DeviceMesh([1, 3]), DeviceMesh(torch.arange(4).reshape(2, 2)), True),  # 1-D and 2-D
    ]
    for mx, my, shard_y in cases:
        with FusionDefinition() as fd:
            x = fd.define_tensor([4, 6])
            y = fd.define_tensor([4, 6])
            z = fd.ops.add(x, y)
            fd.add_output(z)
            x.set_device_mesh(mx)
            y.set_device_mesh(my)
            z.set_device_mesh(my)
            x.outer_split(0, 2)
            x.axis(0).parallelize(ParallelType.mesh_x)
            if shard_y:
                y.outer_split(1, 2)
                y.axis(1).parallelize(ParallelType.mesh_x)
        (out,) = fd.execute([shard_tensor(xf, x), shard_tensor(yf, y)])
        want = shard_tensor(xf + yf, fd.output_shardings()[0])
        torch.testing.assert_close(out, want, msg=f"{mx} + {my}\n{fd.plan}")
        _in_step()


@pytest.mark.ranks(4)
def test_operands_on_different_meshes(multidevice_test):
    _cross_mesh(multidevice_test.rank, multidevice_test.size)


def _two_linears_on(mesh: DeviceMesh, tokens: int = -1):
    """x [tokens, 6] -> column-parallel then row-parallel linear on ``mesh`` (one allreduce)."""
    with FusionDefinition() as fd:
        x, w1, w2 = fd.define_tensor([tokens, 6]), fd.define_tensor([8, 6]), fd.define_tensor([6, 8])
        z = fd.ops.linear(fd.ops.linear(x, w1), w2)
        fd.add_output(z)
        for tv in (x, w1, w2, z):
            tv.set_device_mesh(mesh)
        w1.outer_split(0, 2)
        w1.axis(0).parallelize(ParallelType.mesh_x)
        w2.outer_split(1, 2)
        w2.axis(1).parallelize(ParallelType.mesh_x)
    return fd, (x, w1, w2)


def _plan_cache_on_every_rank(rank: int, world: int) -> None:
    """Every rank finds a cached plan or builds one at the same call (building is collective), for
    inputs that differ between ranks only where a plan does not depend on them."""
    g = torch.Generator().manual_seed(2)
    w1f, w2f = torch.randn(8, 6, generator=g), torch.randn(6, 8, generator=g)

    def run(fd, tvs, xf, tweak=lambda i, t: t):
        ins = [tweak(i, shard_tensor(f, tv)) for i, (f, tv) in enumerate(zip((xf, w1f, w2f), tvs))]
        (out,) = fd.execute(ins)
        torch.testing.assert_close(out, shard_tensor(xf @ w1f.T @ w2f.T, fd.output_shardings()[0]))
        _in_step()

    # A mesh of some ranks and a symbolic extent: the ranks outside it cannot see the extent change.
    fd, tvs = _two_linears_on(DeviceMesh([0, 1]))
    for tokens in (4, 10, 4):
        run(fd, tvs, torch.randn(tokens, 6, generator=g))
    assert fd.plan.collectives() == ["allreduce"], str(fd.plan)

    # One rank passes an input in another layout (no layout declared): the plan is the same.
    fd, tvs = _two_linears_on(DeviceMesh(range(world)[:2]), tokens=4)
    xf = torch.randn(4, 6, generator=g)
    run(fd, tvs, xf)
    run(fd, tvs, xf, lambda i, t: t.T.contiguous().T if rank == 1 and i == 0 else t)

    # A rank outside the mesh passes the full tensor instead of an empty one, before and after a good call.
    fd, tvs = _two_linears_on(DeviceMesh([1, 2]), tokens=4)
    for _ in range(2):
        ins = [f if rank == 0 else shard_tensor(f, tv) for f, tv in zip((xf, w1f, w2f), tvs)]
        want = r"execute: rank 0 holds no part of input T0 \(its mesh is \[1, 2\]\) and must pass an empty tensor"
        _raises(InputError, want if rank == 0 else "rank 0 rejected its inputs: " + want,
                lambda ins=ins: fd.execute(ins))
        run(fd, tvs, xf)

    # A pipeline: stage 1 holds no part of the input whose symbolic extent sizes what it receives.
    with FusionDefinition() as fd:
        x, w1, w2 = fd.define_tensor([-1, 6]), fd.define_tensor([8, 6]), fd.define_tensor([6, 8])
        h = fd.ops.set(fd.ops.linear(x, w1))
        z = fd.ops.linear(h, w2)
        fd.add_output(z)
        for tv in (x, w1):
            tv.set_device_mesh(DeviceMesh([0]))
        for tv in (w2, h, z):
            tv.set_device_mesh(DeviceMesh([1]))
    for tokens in (2, 6):
        run(fd, (x, w1, w2), torch.randn(tokens, 6, generator=g))
    assert fd.plan.collectives() == ["send_recv"], str(fd.plan)


@pytest.mark.ranks(4)
def test_plan_cache_agrees_across_ranks(multidevice_test):
    _plan_cache_on_every_rank(multidevice_test.rank, multidevice_test.size)


@pytest.mark.ranks(2)
def test_a_bad_input_on_a_cached_plan_under_nccl_leaves_no_peer_waiting(multidevice_test, monkeypatch):
    """Under NCCL a cached plan runs without agreement, so a rank that alone passes a bad layout or a
    non-empty tensor for an input it holds no part of finds its peers in the plan's collectives: it runs
    the plan on stand-ins, then raises; the peers get right results (before, they waited in the
    allgather until the group's timeout). Seen here on gloo, with the executor agreeing as under NCCL."""
    from tp_fusion import InputError, executor

    monkeypatch.setattr(executor, "agrees_every_call", lambda backend: False)
    rank = multidevice_test.rank
    mesh = DeviceMesh([0, 1])
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6], contiguity=[True, True])
        u = fd.define_tensor([3])
        y = fd.ops.set(fd.ops.mul(x, 2.0))
        fd.add_output(y)
        fd.add_output(fd.ops.add(u, 1.0))
        for tv in (x, y):
            tv.set_device_mesh(mesh)  # y replicated on it: an allgather
        x.outer_split(0, 2)
        x.axis(0).parallelize(ParallelType.mesh_x)
        u.set_device_mesh(DeviceMesh([0]))  # rank 1 holds no part of u
    full_x, full_u = torch.randn(4, 6), torch.randn(3)
    good = [shard_tensor(full_x, x), shard_tensor(full_u, u)]
    bad_layout = [good[0].t().contiguous().t(), good[1]]  # the same values, column-major
    bad_unheld = [good[0], torch.ones(3)]  # rank 1 passes a full tensor for u

    def check(outs):
        torch.testing.assert_close(outs[0], full_x * 2.0)
        if rank == 0:
            torch.testing.assert_close(outs[1], full_u + 1.0)

    check(fd.execute(good))  # compiles: every rank agrees
    for bad, why in ((bad_layout, "does not match its declared layout"), (bad_unheld, "must pass an empty tensor")):
        if rank == 1:
            with pytest.raises(InputError, match=f"{why}.*ran the plan on stand-ins"):
                fd.execute(bad)
        else:
            check(fd.execute(good))
        _in_step()
    check(fd.execute(good))  # the group is sound


def _meshes_out_of_order_and_broadcasts(rank: int, world: int) -> None:
    """A collective that places pieces by position on a mesh axis listed out of increasing order puts
    them by mesh position (torch numbers a group's ranks increasingly: the pieces are reordered); a
    broadcast runs on its own group only (a rank of the source mesh outside it once ran it on a group
    it is not in)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([8])
        y = fd.ops.neg(x)
        fd.add_output(y)
        for tv in (x, y):
            tv.set_device_mesh(DeviceMesh([3, 2, 1, 0]))
        x.outer_split(0, 4)
        x.axis(0).parallelize(ParallelType.mesh_x)
    (out,) = fd.execute([shard_tensor(torch.arange(8.0), x)])
    assert fd.plan.collectives() == ["allgather"]
    torch.testing.assert_close(out, -torch.arange(8.0))
    _in_step()

    # Three fusions on meshes of some ranks, in this order (found by a fuzz): the third broadcasts from
    # rank 0 to rank 3, a group (0, 3) that leaves ranks 1 and 2 out.
    g = torch.Generator().manual_seed(0)

    def run(fd, tvs, fulls, ref):
        (out,) = fd.execute([shard_tensor(f, tv) for f, tv in zip(fulls, tvs)])
        torch.testing.assert_close(out, shard_tensor(ref, fd.output_shardings()[0]), atol=1e-5, rtol=1e-5)
        _in_step()

    with FusionDefinition() as fd:
        t0, t4 = fd.define_tensor([12, 4, 8]), fd.define_tensor([12, 8, 4])
        t1 = fd.ops.unsqueeze(t0, 2)
        t2 = fd.ops.set(t1)
        fd.add_output(fd.ops.matmul(fd.ops.mean(t2, [1]), t4))
        for tv in (t0, t2, t4):
            tv.set_device_mesh(DeviceMesh([0]))
        t1.set_device_mesh(DeviceMesh([3, 2, 1, 0]))
    a, b = torch.randn(12, 4, 8, generator=g), torch.randn(12, 8, 4, generator=g)
    run(fd, (t0, t4), (a, b), torch.matmul(a.unsqueeze(2).mean(1), b))
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 8])
        z = fd.ops.unsqueeze(fd.ops.softmax(x, -1), 0)
        fd.add_output(z)
        x.set_device_mesh(DeviceMesh(torch.tensor([[2, 3]])))
        x.outer_split(0, 2)
        x.axis(0).parallelize(ParallelType.mesh_x)
        z.set_device_mesh(DeviceMesh([2, 3]))
    a = torch.randn(4, 8, generator=g)
    run(fd, (x,), (a,), torch.softmax(a, -1).unsqueeze(0))
    with FusionDefinition() as fd:
        t0, t2 = fd.define_tensor([8, 8, 8]), fd.define_tensor([1, 1, 8])
        t4 = fd.ops.slice(fd.ops.mul(t2, fd.ops.gelu(t0, approximate="tanh")), [4, 0, 0], [8, 8, 8])
        fd.add_output(t4)
        t0.set_device_mesh(DeviceMesh(range(world - 1)))  # without rank 3 (which would hold it already)
        for tv in (t2, t4):
            tv.set_device_mesh(DeviceMesh([3]))
    a, b = torch.randn(8, 8, 8, generator=g), torch.randn(1, 1, 8, generator=g)
    run(fd, (t0, t2), (a, b), (b * torch.nn.functional.gelu(a, approximate="tanh"))[4:])
    assert "broadcast" in fd.plan.collectives(), str(fd.plan)


@pytest.mark.ranks(4)
def test_meshes_out_of_order_and_broadcasts_to_some_ranks(multidevice_test):
    _meshes_out_of_order_and_broadcasts(multidevice_test.rank, multidevice_test.size)


@pytest.mark.skipif(dist.is_initialized(), reason="needs no process group")
def test_sharded_fusion_without_a_process_group():
    fd, x = _sharded_relu(2, rows=4)
    with pytest.raises(InputError, match=re.escape("no torch.distributed process group is initialized")):
        fd.execute([torch.ones(2, 4)])
    fd_big, _ = _sharded_relu(4, rows=4)  # a mesh larger than the world of 1: still the missing group
    with pytest.raises(InputError, match="no torch.distributed process group"):
        fd_big.execute([torch.ones(1, 4)])


def _one_rank_misuse(rank: int, world: int) -> None:
    """What one rank alone gets wrong raises on every rank at the same call, and the next good call
    runs on every rank alike (before, the ranks fell one call apart and returned wrong data, or waited
    for the process group's timeout)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    import tp_fusion
    from tp_fusion.errors import UnsupportedPlacementError

    last = rank == world - 1
    g = torch.Generator().manual_seed(3)
    mesh = DeviceMesh(range(world))

    # A fusion whose symbolic extent only rank 0 sees exchanges it first: a peer executing another
    # fusion there (or the same one defined with a concrete extent) is told so.
    def on_rank_0(rows: int):
        with FusionDefinition() as fd:
            x = fd.define_tensor([rows, 4])
            s = fd.ops.sum(x, [0])
            fd.add_output(s)
            x.set_device_mesh(DeviceMesh([0]))
            s.set_device_mesh(mesh)
        return fd, x

    relu, _ = _sharded_relu(world, rows=2 * world)
    xf, yf = torch.randn(3, 4, generator=g), torch.randn(2 * world, 4, generator=g)
    exchanged, x = on_rank_0(-1)
    other = "executed another fusion"
    _raises(DefinitionError, other, lambda: relu.execute([shard_tensor(yf, relu.fusion.tensor(0).sharding)]) if last
            else exchanged.execute([shard_tensor(xf, x)]))
    concrete, xc = on_rank_0(3)
    _raises(DefinitionError, other, lambda: concrete.execute([shard_tensor(xf, xc)]) if last
            else exchanged.execute([shard_tensor(xf, x)]))
    (s,) = exchanged.execute([shard_tensor(xf, x)])
    torch.testing.assert_close(s, xf.sum(0))

    # Not a list of inputs, on one rank.
    bad = 5 if last else [shard_tensor(yf, relu.fusion.tensor(0).sharding)]
    _raises(InputError, r"input T0 must be a torch.Tensor, got int", lambda: relu.execute(bad))
    (y,) = relu.execute([shard_tensor(yf, relu.fusion.tensor(0).sharding)])
    torch.testing.assert_close(y, yf.relu())

    # A plan with a fused segment (its building is collective) rebuilt on one rank only: after a schedule
    # call that changes nothing, and after a change undone.
    with FusionDefinition() as fd:
        a, w = fd.define_tensor([4, 2 * world]), fd.define_tensor([6, 2 * world])
        z = fd.ops.linear(a, w)
        fd.add_output(z)
        for tv in (a, w, z):
            tv.set_device_mesh(mesh)
        for tv in (a, w):
            tv.outer_split(1, world)
            tv.axis(1).parallelize(ParallelType.mesh_x)
    af, wf = torch.randn(4, 2 * world, generator=g), torch.randn(6, 2 * world, generator=g)
    for step in range(3):
        if last and step == 1:
            z.set_device_mesh(mesh)  # the mesh it has
        if last and step == 2:
            z.set_device_mesh(DeviceMesh([0]))
            z.set_device_mesh(mesh)
        (out,) = fd.execute([shard_tensor(af, a), shard_tensor(wf, w)])
        torch.testing.assert_close(out, af @ wf.T)
        _in_step()

    # execute_with_dtensors and autograd check their arguments on every rank alike.
    tmesh = init_device_mesh("cpu", (world,))
    dx, dw = distribute_tensor(af, tmesh, [Shard(1)]), distribute_tensor(wf, tmesh, [Shard(1)])
    partial = DTensor.from_local(wf / world, tmesh, [Partial()], run_check=False)
    with FusionDefinition() as plain:
        pa, pw = plain.define_tensor([4, 2 * world]), plain.define_tensor([6, 2 * world])
        plain.add_output(plain.ops.linear(pa, pw))
    cases = [(InputError, "the fusion takes 2 inputs", [dx]),
             (UnsupportedPlacementError, "Partial", [dx, partial]),
             (UnsupportedPlacementError, r"input 1 is a DTensor sharded as .* every rank must pass DTensors of the "
                                         "same placements", [dx, distribute_tensor(wf, tmesh, [Replicate()])])]
    for cls, match, args in cases:
        _raises(cls, match, lambda args=args: tp_fusion.execute_with_dtensors(plain, args if last else [dx, dw]),
                base=Exception)
        (zd,) = tp_fusion.execute_with_dtensors(plain, [dx, dw])
        torch.testing.assert_close(zd.full_tensor(), af @ wf.T)

    with FusionDefinition() as fwd:
        fwd.add_output(fwd.ops.linear(fwd.define_tensor([4, 2 * world]), fwd.define_tensor([6, 2 * world])))
    with FusionDefinition() as bwd:
        ba, bw, bg = (bwd.define_tensor(s) for s in ([4, 2 * world], [6, 2 * world], [4, 6]))
        bwd.add_output(bwd.ops.matmul(bg, bw))
        bwd.add_output(bwd.ops.matmul(bwd.ops.permute(bg, [1, 0]), ba))
    linear = tp_fusion.autograd.function(fwd, bwd, saved_inputs=[0, 1])
    _raises(InputError, "the fusion takes 2 inputs", lambda: linear.apply(dx) if last else linear.apply(dx, dw))
    torch.testing.assert_close(linear.apply(dx, dw).full_tensor(), F.linear(af, wf))


@pytest.mark.ranks(2, 4)
def test_what_one_rank_gets_wrong_raises_on_every_rank(multidevice_test):
    _one_rank_misuse(multidevice_test.rank, multidevice_test.size)


@pytest.mark.ranks(2)
def test_a_top_k_beyond_a_symbolic_extent_raises_on_every_rank(multidevice_test):
    """A top-2 of a symbolic dim bound to 0, on a mesh of rank 0 alone: rank 0 failed inside the plan (an
    ExecutionError that tore its process group down) while rank 1, which holds no part of it, returned. The
    bound extent is checked before running: an InputError on both ranks (found by test_properties_sizes)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([2, -1])
        fd.add_output(fd.ops.topk(x, 2, 1)[0])
        x.set_device_mesh(DeviceMesh([0]))
    _raises(InputError, r"topk: cannot apply to T0 f32\[2, 0\]: k 2 is out of range",
            lambda: fd.execute([shard_tensor(torch.ones(2, 0), x)]))
    full = torch.arange(6.0).reshape(2, 3)
    (out,) = fd.execute([shard_tensor(full, x)])
    torch.testing.assert_close(out, shard_tensor(full.topk(2, 1).values, fd.output_shardings()[0]))
