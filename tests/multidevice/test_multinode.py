"""Two nodes on one host: two ``torchrun --nnodes 2 --nproc_per_node 2`` launches that meet through
a c10d rendezvous run examples/dp_tp_mlp.py on 4 CPU ranks with gloo (a 2x2 mesh, one row a node)."""

from __future__ import annotations

import socket
import subprocess
import sys
import uuid

from conftest import ROOT, user_env


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
