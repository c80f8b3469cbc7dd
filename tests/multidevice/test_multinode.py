"""Multi-node: two ``torchrun --nnodes 2 --nproc_per_node 2`` launches on one machine that meet through
a c10d rendezvous run examples/dp_tp_mlp.py on 4 CPU ranks with gloo (a 2x2 mesh, one row a node);
and on simulated hosts, fused segments whose group spans hosts fall back to plain collectives."""

from __future__ import annotations

import socket
import subprocess
import sys
import uuid

import pytest
import torch
from conftest import ROOT, user_env

from tp_fusion import DeviceMesh, FusionDefinition, ParallelType
from tp_fusion.runtime import symm


def _free_port() -> int:
    # The launches need the rendezvous address before either starts; a port taken meanwhile fails the test loudly.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_nodes_run_the_dp_tp_example():
    rdzv = ["--nnodes", "2", "--nproc_per_node", "2", "--rdzv_backend", "c10d",
            "--rdzv_endpoint", f"127.0.0.1:{_free_port()}", "--rdzv_id", uuid.uuid4().hex]
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *rdzv, "examples/dp_tp_mlp.py"],
                              cwd=ROOT, env=user_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        outs = [node.communicate(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, (out, err) in zip(nodes, outs):
        assert node.returncode == 0, f"a node exited {node.returncode}\n{out}\n{err[-4000:]}"
    out = "".join(o for o, _ in outs)
    assert "mesh [2, 2]" in out and "collectives: ['allreduce']" in out
    assert "OK: the DP x TP MLP matches the aten reference on every rank" in out


@pytest.mark.ranks(4)
def test_fused_segments_fall_back_where_a_group_spans_hosts(multidevice_test, monkeypatch):
    """Two simulated hosts, ranks 0-1 and 2-3: a tensor-parallel group within a host keeps the fused
    kernel; one across both hosts runs sequential (no symmetric memory), and the plan says why."""
    rank = multidevice_test.rank
    monkeypatch.setenv(symm.HOST_ENV, f"node{rank // 2}")
    mesh = DeviceMesh(torch.arange(4).reshape(2, 2))  # rows are the hosts
    for ptype, group, fallback in ((ParallelType.mesh_x, (0, 1), False), (ParallelType.mesh_y, (0, 2), True)):
        with FusionDefinition() as fd:
            x = fd.define_tensor([8, 4])
            w = fd.define_tensor([6, 4])
            fd.add_output(fd.ops.linear(x, w))
            for tv, dim in ((x, 0), (w, 0)):
                tv.set_device_mesh(mesh)
                tv.outer_split(dim, 2)
                tv.axis(dim).parallelize(ptype)
        full = [torch.randn(8, 4), torch.randn(6, 4)]
        (out,) = fd.execute([multidevice_test.shard_tensor(t, tv) for t, tv in zip(full, (x, w))])
        torch.testing.assert_close(out, multidevice_test.shard_tensor(full[0] @ full[1].T, fd.output_shardings()[0]))
        plan = str(fd.plan)
        assert "fused allgather+linear" in plan, plan
        if fallback and rank == 0:
            assert "(sequential)" in plan, plan
            assert (f"tuning: segment 0 allgather+linear: group {list(group)} spans hosts node0, node1; "
                    "symmetric memory needs one host -> sequential (gloo collectives)") in plan, plan
        elif not fallback:
            assert "(fused)" in plan and "spans hosts" not in plan, plan
