"""The end-to-end cases of tests/multidevice/test_end_to_end.py on CUDA ranks with NCCL.

    torchrun --nproc_per_node=2 tests/gpu/nccl_end_to_end.py     # also 4 (adds the 2x2 mesh cases)

Prints one line per failing case and a closing 'N passed, M failed'; exits non-zero on failure.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "multidevice")]

from test_end_to_end import CASES_1D, CASES_2D, run_cases  # noqa: E402

from tp_fusion.launch import init_from_env  # noqa: E402
from tp_fusion.runtime import dist  # noqa: E402


def main() -> int:
    device = init_from_env()
    world, rank = dist.world_size(), dist.rank()
    results = run_cases(rank, world, list(CASES_1D), list(CASES_2D) if world == 4 else [], device, special=False)
    failed = {name: err for name, err in results.items() if err}
    if rank == 0:
        for name, err in failed.items():
            print(f"FAILED {name}:\n{err}")
        print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
