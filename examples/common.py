"""What the examples share: dtype names, tolerances, and one check of a fusion against aten."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tp_fusion import DataType, FusionDefinition, shard_tensor
from tp_fusion.runtime import dist

DTYPES = {"f32": (torch.float32, DataType.Float), "bf16": (torch.bfloat16, DataType.BFloat16),
          "f64": (torch.float64, DataType.Double)}
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, in float64 (0 for an empty shard)."""
    if want.numel() == 0:
        return 0.0
    return (got.double() - want).abs().max().item() / max(want.abs().max().item(), 1e-30)


def execute_and_check(rank: int, fd: FusionDefinition, full: list[torch.Tensor], reference: torch.Tensor,
                      title: str, expected_collectives: list[str] | None = None,
                      explain: bool = False) -> tuple[list[torch.Tensor], float]:
    """Execute ``fd`` on this rank's shards of the ``full`` inputs and compare its output shard with
    the same shard of ``reference`` (the unsharded aten result). Rank 0 prints the fusion, the plan,
    its collectives (and with ``explain`` its summary) and every rank's max relative error. Exits
    on a plan with other collectives than expected or an error above the dtype's tolerance.
    A plan on one rank runs no collective, so there none is expected.
    Returns (this rank's local inputs, the max error over ranks)."""
    tvs = [fd.fusion.tensor(i) for i in fd.fusion.inputs]
    local = [shard_tensor(t, tv.sharding, rank) for t, tv in zip(full, tvs)]
    (out,) = fd.execute(local)
    expected = shard_tensor(reference, fd.output_shardings()[0], rank)
    errors = dist.gather_from_all(relative_error(out, expected))
    collectives = fd.plan.collectives()
    if expected_collectives is not None and dist.world_size() <= 1:
        expected_collectives = []
    if rank == 0:
        print(f"===== {title}, {out.device.type} =====")
        print(fd)
        print(fd.plan)
        print(f"collectives: {collectives}")
        if explain:
            print(fd.plan.summary())
        print(f"max relative error per rank vs aten: {[f'{e:.2e}' for e in errors]}")
    if expected_collectives is not None and collectives != expected_collectives:
        raise SystemExit(f"rank {rank}: {title}: the plan ran {collectives}, expected {expected_collectives}")
    tolerance = TOLERANCE[full[0].dtype]
    if max(errors) > tolerance:
        raise SystemExit(f"rank {rank}: {title}: error {max(errors):.3e} exceeds {tolerance:.0e}")
    return local, max(errors)


def profile(rank: int, world: int, step, out_dir: Path, title: str) -> None:
    """A Chrome trace of a few calls of ``step`` per rank; then rank 0 prints where the time goes per rank
    and by kernel (``tp_fusion.profiling``) and draws a timeline PNG titled ``title``."""
    from tp_fusion import profiling

    profiling.profile_iterations(step, out_dir / f"trace_rank{rank}.json")
    dist.barrier()  # every rank's trace is written
    if rank != 0:
        return
    traces = [out_dir / f"trace_rank{r}.json" for r in range(world)]
    print(f"profile: wrote {', '.join(map(str, traces))}")
    print(profiling.describe(traces, top=25))
    try:
        png = profiling.plot_timeline(traces, out_dir / "timeline.png", title=title)
        print(f"profile: wrote {png}")
    except ImportError as e:
        print(f"profile: no timeline.png: {e}", file=sys.stderr)
