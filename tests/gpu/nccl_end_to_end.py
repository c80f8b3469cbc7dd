"""The end-to-end cases of tests/multidevice/test_end_to_end.py on CUDA ranks with NCCL.

    torchrun --nproc_per_node=2 tests/gpu/nccl_end_to_end.py     # also 4 (adds the 2x2 mesh cases)

Prints the warnings of each case that warned (rank 0's), one line per failing case and a closing
'N passed, M failed'; exits non-zero on failure. A plan that could not be captured as a CUDA graph (it
warns so and runs eagerly) fails its case: every case's plan is capturable.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "multidevice")]  # tests/conftest.py helpers

from test_end_to_end import CASES_1D, CASES_2D, run_cases  # noqa: E402

from tp_fusion import DataType  # noqa: E402
from tp_fusion.launch import init_from_env  # noqa: E402
from tp_fusion.runtime import dist  # noqa: E402


def graph_replay_check(rank: int, world: int, device) -> str | None:
    """A small SP MLP executed repeatedly (the plan may switch to a CUDA graph on its second run):
    every call must match torch, and earlier outputs must stay as they were."""
    import torch
    import torch.nn.functional as F

    from tp_fusion import shard_tensor
    sys.path.insert(0, str(ROOT / "examples"))
    from tp_mlp import define_mlp, reference_inputs

    fd = define_mlp(256, 256, world, "sp", DataType.Float)
    tvs = [fd.fusion.tensor(i) for i in fd.fusion.inputs]
    kept = []
    for step in range(4):
        full = reference_inputs(256, 256, torch.float32, device)
        full[0] = full[0] + step
        (out,) = fd.execute([shard_tensor(t, tv.sharding, rank) for t, tv in zip(full, tvs)])
        want = shard_tensor(F.linear(F.gelu(F.linear(full[0], full[1], full[2]), approximate="tanh"),
                                     full[3], full[4]), fd.output_shardings()[0], rank)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
        kept.append((out, out.clone()))
    for out, copy in kept:
        if not torch.equal(out, copy):
            return "an earlier output changed after a later execute"
    if rank == 0:
        print(f"graph replay check: plan {'replayed as a CUDA graph' if fd.plan.cuda_graph else 'eager'}")
    return None


def main() -> int:
    device = init_from_env()
    world, rank = dist.world_size(), dist.rank()
    warned: dict[str, list[str]] = {}
    results = run_cases(rank, world, list(CASES_1D), list(CASES_2D) if world == 4 else [], device, special=False,
                        warned=warned)
    try:
        results["graph_replay"] = graph_replay_check(rank, world, device)
    except Exception as e:  # noqa: BLE001 - reported like the other cases
        results["graph_replay"] = f"rank {rank}: {type(e).__name__}: {e}"
    for name, messages in warned.items():  # every plan of these cases is capturable: a fallback is a defect
        fallbacks = [m for m in messages if "could not capture" in m]
        if fallbacks and not results.get(name):
            results[name] = f"rank 0: fell back to eager launches: {fallbacks[0]}"
    failed = {name: err for name, err in results.items() if err}
    if rank == 0:
        for name, messages in warned.items():  # e.g. a plan that could not be captured as a CUDA graph
            print(f"warned {name}: {' | '.join(messages)}")
        for name, err in failed.items():
            print(f"FAILED {name}:\n{err}")
        print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
