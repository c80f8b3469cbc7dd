"""The examples run plainly (spawning CPU ranks with gloo), check themselves and print OK."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import Counter

import pytest
from conftest import ROOT, user_env


@pytest.mark.parametrize("script,args,expect", [
    ("examples/tp_mlp.py", [], ["collectives: ['allreduce']", "collectives: ['allgather', 'reduce_scatter']",
                                "OK: tp, sp match the aten reference on every rank"]),
    ("examples/linear_tp.py", [], ["collectives: []", "collectives: ['allreduce']",
                                   "OK: column- and row-parallel linear layers match the aten reference"]),
    # one rank: no collective, not even sp's allgather and reduce_scatter, or row-parallel's allreduce
    ("examples/tp_mlp.py", ["--nproc", "1", "--mode", "sp"],
     ["mode sp: 1 ranks", "collectives: []", "OK: sp matches the aten reference on every rank"]),
    ("examples/linear_tp.py", ["--nproc", "1", "--mode", "row"],
     ["row-parallel linear: 1 ranks", "collectives: []", "OK: row-parallel linear matches the aten reference"]),
    ("examples/dp_tp_mlp.py", [], ["mesh [2, 2]", "collectives: ['allreduce']", "allreduce(T8, mesh_axis=1)",
                                   "OK: the DP x TP MLP matches the aten reference on every rank"]),
])
def test_example_runs_and_validates(script, args, expect):
    env = user_env()
    proc = subprocess.run([sys.executable, script, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    out = proc.stdout
    assert proc.returncode == 0, f"{script} exited {proc.returncode}\n{out}\n{proc.stderr[-4000:]}"
    for text in expect:
        assert text in out, f"{text!r} missing from the output of {script}:\n{out}"
    assert "Plan:" in out  # the plan is printed


@pytest.mark.parametrize("script,args,torchrun_world,error", [
    ("linear_tp.py", ["--in-features", "33"], None, "--in-features 33 must be a multiple of --nproc 2"),
    ("linear_tp.py", ["--mode", "column", "--out-features", "3", "--tokens", "0"], None,
     "--tokens 0 must be at least 1"),
    ("tp_mlp.py", ["--tokens", "31"], None, "--tokens 31 must be a multiple of --nproc 2"),
    ("tp_mlp.py", ["--nproc", "3"], None, "the MLP's inner size (4 x --hidden) 128 must be a multiple of --nproc 3; "
                                          "--tokens 64 must be a multiple of --nproc 3"),
    ("tp_mlp.py", ["--tokens", "0"], None, "--tokens 0 must be at least 1"),
    ("tp_mlp.py", ["--nproc", "0"], None, "--nproc 0 must be at least 1"),
    # under torchrun its WORLD_SIZE is the number of ranks, not --nproc
    ("tp_mlp.py", ["--mode", "sp"], 3, "the MLP's inner size (4 x --hidden) 128 must be a multiple of WORLD_SIZE 3; "
                                       "--tokens 64 must be a multiple of WORLD_SIZE 3"),
    ("dp_tp_mlp.py", ["--nproc", "4", "--tp", "3"], None,
     "--nproc 4 must be a multiple of --tp 3; the MLP's inner size (4 x --hidden) 64 must be a multiple of --tp 3"),
    ("dp_tp_mlp.py", ["--nproc", "6", "--tp", "2", "--batch", "4"], None,
     "--batch 4 must be a multiple of the data-parallel ranks (--nproc / --tp) 3"),
    ("transformer_layer.py", ["--heads", "3"], None,
     "--hidden 32 must be a multiple of --heads 3; --heads 3 must be a multiple of --nproc 2"),
    ("transformer_layer.py", ["--tokens", "12", "--mode", "tp"], None, "--tokens 12 must be a multiple of --seq 8"),
    ("transformer_layer.py", ["--dropout", "1"], None, "--dropout 1.0 must be at least 0 and below 1"),
])
def test_example_refuses_bad_sizes_before_starting_ranks(script, args, torchrun_world, error):
    """A size that the example's sharding cannot take is one usage error naming the flag and only the
    constraints that failed, from argparse: no rank started (torch was not even imported), no traceback."""
    env = user_env()
    if torchrun_world:
        env.update(RANK="0", WORLD_SIZE=str(torchrun_world), LOCAL_RANK="0")
    proc = subprocess.run([sys.executable, "-X", "importtime", f"examples/{script}", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, f"exited {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.stderr.splitlines()[-1] == f"{script}: error: {error}", proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    imported = re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", proc.stderr, re.MULTILINE)
    assert imported and "torch" not in imported


def test_transformer_layer_forward_and_backward_validate():
    """Both modes, with dropout, in one run (spawning ranks is the slow part)."""
    env = user_env()
    proc = subprocess.run([sys.executable, "examples/transformer_layer.py", "--dropout", "0.1"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    out = proc.stdout
    assert proc.returncode == 0, f"exited {proc.returncode}\n{out}\n{proc.stderr[-4000:]}"
    assert "OK: tp, sp: the output and every gradient shard match torch on every rank" in out, out
    assert "forward collectives: ['allreduce', 'allreduce']" in out, out
    assert "forward collectives: ['allgather', 'reduce_scatter', 'allgather', 'reduce_scatter']" in out, out
    assert "--- backward fusion" in out and "sdpfa_bwd(" in out and "rng_seed=2026" in out, out
    # aten's fused kernels, as torch's autograd runs them; no decomposed layer norm or GELU gradient
    for op in ("native_layer_norm(", "native_layer_norm_backward(", "gelu_backward("):
        assert op in out, f"{op} missing:\n{out}"
    for op in ("var_mean(", "rsqrt(", "tanh(", "mean("):
        assert op not in out, f"{op} in the plans:\n{out}"
    # the backward's collectives: tp, the two partial input gradients of the attention and the MLP; sp,
    # besides, the gathers of the weight-gradient operands and the allreduces of the summed gradients
    backward = [Counter(ast.literal_eval(line.split(": ", 1)[1])) for line in out.splitlines()
                if line.startswith("backward collectives: ")]
    assert backward == [Counter(allreduce=2), Counter(allgather=4, reduce_scatter=2, allreduce=6)], out


@pytest.mark.parametrize("mode,training,want", [
    ("sp", True, ["fused allgather+linear", "fused linear+reduce_scatter+add+add", "fused allgather+linear",
                  "fused linear+reduce_scatter+add+add"]),
    # Inference keeps no fc1 output for a backward, so its GELU joins the allgather's GEMM epilogue.
    ("sp", False, ["fused allgather+linear", "fused linear+reduce_scatter+add+add", "fused allgather+linear+gelu",
                   "fused linear+reduce_scatter+add+add"]),
    ("tp", True, ["fused linear+allreduce+add+add", "fused linear+allreduce+add+add"]),
    ("tp", False, ["fused linear+allreduce+add+add", "fused linear+allreduce+add+add"])])
def test_transformer_layer_plan_fuses_its_collectives_on_cuda(monkeypatch, mode, training, want):
    """Compiled for CUDA (no GPU needed), the forward's collectives are fused segments with their GEMMs:
    in sp the allgathers (before QKV and the MLP) and reduce_scatters (after the out-projection and the
    MLP), in tp the allreduces after the out-projection and the MLP; the reductions take their bias
    add and the residual add after it."""
    monkeypatch.syspath_prepend(str(ROOT))
    from examples.transformer_layer import INPUTS, Config, define_forward
    from tp_fusion import DataType

    cfg = Config(tokens=256, seq=128, hidden=256, heads=4, d=2, mode=mode, dtype=DataType.BFloat16)
    fd = define_forward(cfg, training=training)
    plan = str(fd.compile([cfg.shape(n) for n in INPUTS], rank=0, device="cuda"))
    segments = [line.split(": ", 1)[1] for line in plan.splitlines() if line.lstrip().startswith("segment")]
    fused = [s.split(" (")[0] for s in segments if s.startswith("fused")]
    assert fused == want, plan
    assert not any(s.startswith("communication") for s in segments), plan
    outputs = re.search(r"outputs \[([^\]]*)\]", plan).group(1).split(", ")
    assert len(outputs) == (15 if training else 1), plan


def test_transformer_layer_benchmark_checks_its_variants_on_cpu():
    """benchmarks/transformer_layer.py --check: every variant it would time (but the compiled ones)
    agrees with NCCL-sequential on gloo ranks, in both passes (fwd: tp_fusion's inference forward);
    tp_fusion and PyTorch TP included."""
    env = user_env()
    proc = subprocess.run([sys.executable, "benchmarks/transformer_layer.py", "--check", "--passes", "fwd", "fwd_bwd"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"exited {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert "OK: every variant agrees with nccl_sequential" in proc.stdout, proc.stdout
    for mode in ("sp fwd", "tp fwd", "sp fwd_bwd", "tp fwd_bwd"):
        assert f"{mode}: checked against nccl_sequential: pytorch_tp" in proc.stdout, proc.stdout
        assert re.search(f"{mode}: .*tp_fusion \\d", proc.stdout), proc.stdout


@pytest.mark.parametrize("script", ["benchmarks/tp_mlp.py", "benchmarks/transformer_layer.py",
                                    "benchmarks/contention.py", "benchmarks/flag_overhead.py"])
def test_a_gpu_benchmark_says_so_on_a_machine_without_gpus(tmp_path, script):
    """Each GPU benchmark imports cleanly, says plainly that there is nothing to measure here, exits 0
    and writes no results."""
    env = user_env()
    env["CUDA_VISIBLE_DEVICES"] = ""
    args = ["--out", str(tmp_path)] if script in ("benchmarks/tp_mlp.py", "benchmarks/transformer_layer.py") else []
    proc = subprocess.run([sys.executable, script, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"exited {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert "no CUDA GPU" in proc.stdout, proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_the_mlp_benchmark_refuses_a_design_it_does_not_have():
    """A design renamed since (round 10's ag_one_stream is the default kernel now) or misspelt is an
    error naming the designs there are, before anything runs, rather than a run that times none."""
    env = user_env()
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, "benchmarks/tp_mlp.py", "--designs", "ag_one_stream", "rs_ring_2_pieces"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    named = re.search(r"--designs: no design named ag_one_stream; the designs are (.*)", proc.stderr)
    assert named and {"ag_two_streams", "rs_ring_2_pieces"} <= set(named[1].split(", ")), proc.stderr[-2000:]
