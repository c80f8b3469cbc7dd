"""The overlap kernels on CPU gloo ranks (world 2 and 4, and subgroups): the fused mode's kernels (the
GPUs' own, over send/recv: ``symm.HostMailbox``) in each ``Tuning`` that shapes their decomposition, and
the sequential mode, against plain torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import rand as _rand

from tp_fusion.runtime import dist, overlap

# Every way of running a fused kernel's decomposition (the stream knobs change nothing on the CPU).
_RUNS = (("sequential", None), ("fused", overlap.Tuning()),
         ("fused", overlap.Tuning(rs_reduce="ring", rs_subchunks=2)),
         ("fused", overlap.Tuning(rs_reduce="ring", rs_remote_store=True)),
         ("fused", overlap.Tuning(rs_subchunks=3, rs_remote_store=True, ar_subchunks=1)),
         # Own rows moved into the GEMM of the next rank's chunk (``overlap._own_split``; on the last
         # of more than two ranks nothing moves) and the bias added by each rank to its own rows.
         ("fused", overlap.Tuning(ag_split_rows=5, rs_split_rows=3)),
         ("fused", overlap.Tuning(ag_split_rows=1, rs_split_rows=7, ag_streams=2, rs_streams=2)))


def _check_group(pg, ranks) -> None:
    """All checks on group ``pg`` (group ranks ``ranks``), comparing with torch on the full inputs."""
    n, r = len(ranks), dist.group_rank(pg)
    w, b = _rand(1, 7, 5), _rand(2, 7)
    x_full = _rand(3, 2 * n, 3 * n, 5)
    for dim in (0, 1):
        x_local = x_full.chunk(n, dim=dim)[r]
        for bias, epilogue in ((None, None), (b, None), (b, overlap.gelu_tanh), (None, torch.tanh)):
            want = F.linear(x_full, w, bias)
            want = epilogue(want) if epilogue else want
            for mode, tuning in _RUNS:
                got = overlap.allgather_linear(x_local, w, bias, gather_dim=dim, pg=pg, epilogue=epilogue, mode=mode,
                                               tuning=tuning)
                torch.testing.assert_close(got, want, msg=f"allgather_linear dim={dim} bias={bias is not None} "
                                                          f"{mode} {tuning}")
    x2 = _rand(4, 2 * n, 5)
    got = overlap.allgather_linear(x2.chunk(n)[r], w, b, gather_dim=-2, pg=pg, epilogue=overlap.gelu_tanh,
                                   mode="fused")
    torch.testing.assert_close(got, overlap.gelu_tanh(F.linear(x2, w, b)))

    # Each rank holds a different x and weight shard; the reference sums all of them.
    xs = [_rand(10 + g, 2 * n, 3 * n, 5) for g in ranks]
    ws = [_rand(20 + g, 7, 5) for g in ranks]
    total = sum(F.linear(x, wg) for x, wg in zip(xs, ws, strict=True))
    for mode, tuning in _RUNS:
        how = f"{mode} {tuning}"
        for dim in (0, 1, -2):
            got = overlap.linear_reduce_scatter(xs[r], ws[r], scatter_dim=dim, pg=pg, mode=mode, tuning=tuning)
            torch.testing.assert_close(got, total.chunk(n, dim=dim)[r], msg=f"linear_reduce_scatter dim={dim} {how}")
        got = overlap.linear_reduce_scatter(xs[r], ws[r], b, scatter_dim=1, pg=pg, mode=mode, tuning=tuning)
        torch.testing.assert_close(got, (total + b).chunk(n, dim=1)[r], msg=f"linear_reduce_scatter bias {how}")
        torch.testing.assert_close(overlap.linear_allreduce(xs[r], ws[r], pg=pg, mode=mode, tuning=tuning), total,
                                   msg=f"linear_allreduce {how}")
        torch.testing.assert_close(overlap.linear_allreduce(xs[r], ws[r], b, pg=pg, mode=mode, tuning=tuning),
                                   total + b, msg=f"linear_allreduce bias {how}")
        # A residual (of the result's shape: this rank's rows after a reduce_scatter) is added once.
        res = _rand(5, 2 * n, 3 * n, 7)
        for dim in (0, 1):
            got = overlap.linear_reduce_scatter(xs[r], ws[r], b, residual=res.chunk(n, dim=dim)[r], scatter_dim=dim,
                                                pg=pg, mode=mode, tuning=tuning)
            torch.testing.assert_close(got, (total + b + res).chunk(n, dim=dim)[r],
                                       msg=f"linear_reduce_scatter residual dim={dim} {how}")
        torch.testing.assert_close(overlap.linear_allreduce(xs[r], ws[r], residual=res, pg=pg, mode=mode,
                                                            tuning=tuning), total + res)
        torch.testing.assert_close(overlap.linear_allreduce(xs[r], ws[r], b, residual=res, pg=pg, mode=mode,
                                                            tuning=tuning), total + b + res)
    odd = [_rand(30 + g, 2 * n + 1, 5) for g in ranks]  # rows that do not split: sequential
    torch.testing.assert_close(overlap.linear_allreduce(odd[r], ws[r], pg=pg, mode="sequential"),
                               sum(F.linear(x, wg) for x, wg in zip(odd, ws, strict=True)))


def _all_checks(rank: int, world: int) -> None:
    _check_group(None, tuple(range(world)))
    if world == 4:  # subgroups: group ranks differ from world ranks
        groups = {ranks: dist.group(ranks) for ranks in ((0, 2), (1, 3))}
        mine = next(ranks for ranks in groups if rank in ranks)
        _check_group(groups[mine], mine)
    with pytest.raises(ValueError, match="last"):
        overlap.allgather_linear(torch.zeros(2, 3), torch.zeros(4, 3), gather_dim=1, pg=None, mode="fused")
    with pytest.raises(ValueError, match="divide"):
        overlap.linear_reduce_scatter(torch.zeros(world + 1, 3), torch.zeros(4, 3), scatter_dim=0, pg=None,
                                      mode="fused")
    with pytest.raises(ValueError, match="mode="):
        overlap.linear_allreduce(torch.zeros(world, 3), torch.zeros(4, 3), pg=None, mode="overlapped")
    with pytest.raises(ValueError, match="split evenly"):
        overlap.linear_allreduce(torch.zeros(world + 1, 3), torch.zeros(4, 3), pg=None, mode="fused")
    with pytest.raises(ValueError, match="residual of shape"):
        overlap.linear_allreduce(torch.zeros(world, 3), torch.zeros(4, 3), residual=torch.zeros(world, 5), pg=None,
                                 mode="fused")


@pytest.mark.ranks(2, 4)
def test_overlap_kernels_match_torch(multidevice_test):
    _all_checks(multidevice_test.rank, multidevice_test.size)


def test_single_process_needs_no_group():
    x, w, b = _rand(0, 4, 3), _rand(1, 5, 3), _rand(2, 5)
    for mode in ("fused", "sequential"):
        torch.testing.assert_close(overlap.allgather_linear(x, w, b, gather_dim=0, pg=None, mode=mode),
                                   F.linear(x, w, b))
        torch.testing.assert_close(overlap.linear_reduce_scatter(x, w, scatter_dim=0, pg=None, mode=mode),
                                   F.linear(x, w))
        torch.testing.assert_close(overlap.linear_allreduce(x, w, pg=None, mode=mode), F.linear(x, w))
        torch.testing.assert_close(overlap.linear_reduce_scatter(x, w, b, scatter_dim=0, pg=None, mode=mode),
                                   F.linear(x, w, b))
        res = _rand(3, 4, 5)
        torch.testing.assert_close(overlap.linear_allreduce(x, w, b, residual=res, pg=None, mode=mode),
                                   F.linear(x, w, b) + res)
        torch.testing.assert_close(overlap.linear_reduce_scatter(x, w, residual=res, scatter_dim=0, pg=None, mode=mode),
                                   F.linear(x, w) + res)


def test_tuning_is_validated():
    with pytest.raises(ValueError, match="rs_reduce"):
        overlap.Tuning(rs_reduce="tree")


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("rows", [0, 1, 5, 7, 8])
def test_own_split_moves_own_rows_beside_the_next_chunk(n, rows):
    """``_own_split``: the first GEMM keeps the rest of this rank's m own rows; the moved ones and chunk
    r+1 form one block of rows of all n * m; where that cannot be (the last of more than two ranks) or
    a GEMM would get no rows, nothing moves."""
    m = 8
    for r in range(n):
        split = overlap._own_split(r, n, m, rows)
        if not 0 < rows < m or (r == n - 1 and n > 2):
            assert split is None
            continue
        lead, moved, joined = split
        assert sorted([*range(m)[lead], *range(m)[moved]]) == list(range(m)) and len(range(m)[moved]) == rows
        nxt = (r + 1) % n
        block = set(range(n * m)[joined])
        assert block == {r * m + i for i in range(m)[moved]} | set(range(nxt * m, (nxt + 1) * m))
        assert block == set(range(min(block), max(block) + 1))  # one block, as one GEMM reads and writes it
