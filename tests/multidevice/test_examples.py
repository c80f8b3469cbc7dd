"""The examples run plainly (spawning CPU ranks with gloo), check themselves and print OK."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script,args,expect", [
    ("examples/tp_mlp.py", [], ["collectives: ['allreduce']", "collectives: ['allgather', 'reduce_scatter']"]),
    ("examples/linear_tp.py", [], ["collectives: []", "collectives: ['allreduce']"]),
    ("examples/dp_tp_mlp.py", [], ["mesh [2, 2]", "collectives: ['allreduce']", "allreduce(T8, mesh_axis=1)"]),
])
def test_example_runs_and_validates(script, args, expect):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, script, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    out = proc.stdout
    assert proc.returncode == 0, f"{script} exited {proc.returncode}\n{out}\n{proc.stderr[-4000:]}"
    assert "OK" in out, out
    for text in expect:
        assert text in out, f"{text!r} missing from the output of {script}:\n{out}"
    assert "Plan:" in out  # the plan is printed


def test_example_fails_loudly_on_a_bad_mesh():
    # 3 ranks do not form rows of 2 tensor-parallel ranks: every rank exits with an error, none hangs.
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "examples/dp_tp_mlp.py", "--nproc", "3"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    assert "OK" not in proc.stdout
    assert "do not form a mesh" in proc.stderr
