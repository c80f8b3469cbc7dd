"""Issue 12, item 14 on GPUs: SIGKILL one rank while its peer loops through ``fd.execute``.

    python tests/gpu/dead_peer.py [--timeout 20] [--tokens 8192 --hidden 8192]

Two spawned CUDA ranks (NCCL, file:// rendezvous, a process-group timeout of ``--timeout`` s) run
a plan in a loop; after a few calls one rank kills itself (SIGKILL) with work in flight. Scenarios:
- ``fused``: the SP MLP through its fused GEMM+allgather / GEMM+reduce_scatter segments (the
  survivor's GPU blocks on a symmetric-memory flag wait, which has no time limit of its own);
- ``nccl``: a plan whose only communication is an NCCL allgather;
- ``fused-store-host``: as ``fused``, but rank 0 (which hosts the store) dies;
- ``nccl-raise``: as ``nccl``, but rank 1 raises a RuntimeError inside its allgather and lives on
  (the survivor must name rank 1 and its error, promptly: it sees rank 1's failure report);
- ``async`` and ``async-raise``: as ``nccl`` and ``nccl-raise``, for a plan whose allgather and
  allreduce run asynchronously (``Program.overlapped``: issued early, awaited late).
The survivor must raise ``ExecutionError`` naming the dead rank within the timeout plus a few
seconds. Prints one line per scenario and exits non-zero if any failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
SLACK_S = 8.0  # what the survivor may take beyond the process-group timeout (report, abort)


def _fusion(kind: str, world: int, args):
    import torch

    from tp_fusion import DataType, DeviceMesh, FusionDefinition, ParallelType

    if kind == "nccl":
        with FusionDefinition() as fd:
            x = fd.define_tensor([args.tokens, args.hidden], dtype=DataType.BFloat16)
            y = fd.ops.relu(fd.ops.set(x))
            fd.add_output(y)
            mesh = DeviceMesh(range(world))
            for tv in (x, y):
                tv.set_device_mesh(mesh)
            x.outer_split(0, world)
            x.axis(0).parallelize(ParallelType.mesh_x)
        return fd, [torch.randn(args.tokens // world, args.hidden, dtype=torch.bfloat16, device="cuda")]
    if kind == "async":  # the column sums' allreduce awaited at the end, the allgather of x issued at the
        #                 start, work on a in between
        with FusionDefinition() as fd:
            x = fd.define_tensor([args.tokens, args.hidden], dtype=DataType.BFloat16)
            a = fd.define_tensor([args.hidden, args.hidden], dtype=DataType.BFloat16)
            colsum = fd.ops.sum(x, [0])
            h = fd.ops.mul(fd.ops.tanh(a), 2.0)
            gathered = fd.ops.set(x)
            out = fd.ops.relu(gathered)
            for tv in (colsum, h, out):
                fd.add_output(tv)
            mesh = DeviceMesh(range(world))
            for tv in (x, a, colsum, h, gathered, out):
                tv.set_device_mesh(mesh)
            x.outer_split(0, world)
            x.axis(0).parallelize(ParallelType.mesh_x)
        return fd, [torch.randn(args.tokens // world, args.hidden, dtype=torch.bfloat16, device="cuda"),
                    torch.randn(args.hidden, args.hidden, dtype=torch.bfloat16, device="cuda")]
    from tp_mlp import define_mlp, reference_inputs

    from tp_fusion import shard_tensor

    fd = define_mlp(args.tokens, args.hidden, world, "sp", DataType.BFloat16)  # ffn = 4 * hidden
    full = reference_inputs(args.tokens, args.hidden, torch.bfloat16, "cuda")
    tvs = [fd.fusion.tensor(i) for i in fd.fusion.inputs]
    return fd, [shard_tensor(t, tv.sharding, dist_rank()) for t, tv in zip(full, tvs)]


def dist_rank() -> int:
    import torch.distributed as tdist

    return tdist.get_rank()


def _rank(rank: int, world: int, kind: str, victim: int, workdir: str, args) -> None:
    import datetime

    import torch
    import torch.distributed as tdist

    from tp_fusion import ExecutionError
    from tp_fusion.runtime import dist

    os.environ["TP_FUSION_TUNE"] = "0"  # fused segments run fused (the flag waits are what is tested)
    torch.cuda.set_device(rank)
    dist.warm_up_before_init()
    tdist.init_process_group("nccl", init_method=f"file://{workdir}/rdzv", rank=rank, world_size=world,
                             timeout=datetime.timedelta(seconds=args.timeout), device_id=torch.device("cuda", rank))
    fd, inputs = _fusion(kind, world, args)
    fd.execute(inputs)
    torch.cuda.synchronize()
    tdist.barrier()
    result = {"rank": rank}
    try:
        for call in range(10_000):
            if rank == victim and call == 5:
                with open(f"{workdir}/died", "w") as f:
                    f.write(str(time.time()))
                if args.raise_error:  # the victim's own error inside a collective: it reports and lives on
                    dist.all_gather = _failing_all_gather
                else:
                    os.kill(os.getpid(), signal.SIGKILL)  # with the GPU work of calls 0-4 in flight
            fd.execute(inputs)
        result["error"] = "the loop ended without an error"
    except ExecutionError as e:
        result.update(raised=time.time(), message=str(e))
    with open(f"{workdir}/result.{rank}", "w") as f:
        json.dump(result, f)
    os._exit(0)  # the process group is aborted; skip teardown


def _failing_all_gather(*args, **kwargs):
    raise RuntimeError("injected failure in all_gather")


def run(kind: str, args) -> tuple[bool, str]:
    import torch.multiprocessing as mp

    victim = 0 if kind.endswith("store-host") else 1
    survivor = 1 - victim
    args = argparse.Namespace(**vars(args), raise_error=kind.endswith("-raise"))
    base = kind.replace("-store-host", "").replace("-raise", "")
    with tempfile.TemporaryDirectory() as workdir:
        ctx = mp.start_processes(_rank, (2, base, victim, workdir, args), nprocs=2, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + args.timeout + 120
        while time.monotonic() < deadline and not os.path.exists(f"{workdir}/result.{survivor}"):
            time.sleep(0.5)
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join()
        if not os.path.exists(f"{workdir}/result.{survivor}"):
            return False, f"{kind}: rank {survivor} gave no result within {args.timeout + 120:.0f} s (hung or crashed)"
        with open(f"{workdir}/result.{survivor}") as f:
            result = json.load(f)
        with open(f"{workdir}/died") as f:
            died = float(f.read())
    if "message" not in result:
        return False, f"{kind}: {result}"
    elapsed, msg = result["raised"] - died, result["message"]
    if args.raise_error:
        named = msg.startswith(f"rank {victim} failed in segment") and "injected failure in all_gather" in msg
    else:
        named = f"rank(s) {victim} stopped responding" in msg or f"rank {victim}, which hosts it" in msg
    ok = named and elapsed < args.timeout + SLACK_S
    return ok, f"{kind}: rank {survivor} raised ExecutionError {elapsed:.1f} s after rank {victim} died " \
               f"(process-group timeout {args.timeout:.0f} s): {msg}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--timeout", type=float, default=20.0, help="process-group timeout, seconds")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--scenarios", default="fused,nccl,fused-store-host,nccl-raise,async,async-raise")
    args = parser.parse_args()
    failed = 0
    for kind in args.scenarios.split(","):
        ok, line = run(kind, args)
        failed += not ok
        print(("PASS " if ok else "FAIL ") + line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
