"""Property tests of attention with a bias or a Bool mask: random ``sdpfa_fwd`` (and
``scaled_dot_product_attention``) fusions of [N*, H, S, E] operands, a bias and a mask that broadcast over some
dims (extent 1), causal or not, a scale or not, in float64, float32, bfloat16 or float16, with random shardings
of batch, heads or rows (of the query, the key and value, the bias and mask, the outputs) on 1-D and 2-D meshes.
Each rank's shard of the output equals torch's ``F.scaled_dot_product_attention`` with nvFuser's bias + mask
(0 where True, -inf elsewhere, summed in the query's dtype) as its ``attn_mask``, and the logsumexp equals the
scores' (in float64) on every row that attends to some key.

As in ``test_properties``: hypothesis draws the seeds (derandomized), each rank rebuilds the case from its seed,
the ranks compare outcomes after each case, and a failing case names its seed (replay it with ``_run_case``).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from property_cases import MESHES_4, ONCE, examples, run_cases, seeds, with_meshes

from tp_fusion import DataType, DeviceMesh, FusionDefinition, ParallelType, TPFusionError, shard_tensor

DTYPES = (DataType.Double, DataType.Double, DataType.Float, DataType.BFloat16, DataType.Half)
# Absolute and relative tolerances of the output by dtype: float64 runs the math path as torch's reference does;
# float32 and half precision run aten's CPU flash kernel, or the math path where a bias meets a causal mask, in
# float32 inside (bf16: nvFuser's test_sdpa tolerances, widened for the sum of bias and mask rounded in bf16)
TOL = {DataType.Double: (1e-9, 1e-7), DataType.Float: (2e-5, 2e-5), DataType.BFloat16: (3e-2, 3e-2),
       DataType.Half: (4e-3, 4e-3)}


class _AttentionCase:
    """One random attention fusion: its definition, full inputs and torch references."""

    def __init__(self, seed: int, mesh: DeviceMesh):
        self.rng = rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.mesh = mesh
        self.dtype = rng.choice(DTYPES)
        nlead = rng.choice((1, 2, 2, 2, 3))  # [H], [B, H] or [B, B2, H] before [S, E]
        lead = [rng.choice((1, 2, 4)) for _ in range(nlead - 1)] + [rng.choice((2, 4))]
        s, sk = rng.choice((0, 1, 2, 3, 4, 6, 8)), rng.choice((0, 1, 2, 4, 5, 8))  # (0: no rows, no keys)
        self.causal = rng.random() < 0.35
        if self.causal and rng.random() < 0.6:
            sk = s
        e, ev = rng.choice((2, 4, 8)), rng.choice((2, 4, 6))
        self.scale = rng.choice((None, None, 0.3, 1.5))
        self.fd = fd = FusionDefinition()
        self.inputs: list = []  # (tv, full)
        q = self._input((*lead, s, e))
        k = self._input((*lead, sk, e))
        v = self._input((*lead, sk, ev))
        scores = (*lead, s, sk)
        self.bias = self.mask = None
        terms = []
        if rng.random() < 0.65:
            self.bias = self._input(self._broadcast(scores))
            terms.append(self.bias)
        if rng.random() < 0.55:
            shape = self._broadcast(scores)
            full = torch.rand(shape, generator=self.gen) < rng.choice((0.5, 0.8, 1.0))
            tv = fd.define_tensor(list(shape), dtype=DataType.Bool)
            self.inputs.append((tv, full))
            self.mask = tv
            terms.append(tv)
        self.qkv = (q, k, v)
        self.plain = not terms and rng.random() < 0.4  # F.scaled_dot_product_attention's spelling
        if self.plain:
            out = fd.ops.scaled_dot_product_attention(q, k, v, is_causal=self.causal, scale=self.scale)
            lse = None
        else:
            by_keyword = rng.random() < 0.5
            if by_keyword:
                out, lse, _, _ = fd.ops.sdpfa_fwd(q, k, v, bias=self.bias, mask=self.mask, is_causal=self.causal,
                                                  scale=self.scale)
            else:
                out, lse, _, _ = fd.ops.sdpfa_fwd(q, k, v, self.bias, self.mask, 0.0, self.causal, self.scale)
        self.post = rng.random() < 0.3  # a pointwise op on the output (its sharding propagates)
        result = fd.ops.mul(out, 2.0) if self.post else out
        fd.add_output(result)
        self.outputs = [result]
        if lse is not None and rng.random() < 0.5:
            fd.add_output(lse)
            self.outputs.append(lse)
        # The schedule: heads or batch (or rows) of the operands, the terms along with them or not, the outputs.
        for tv in (q, k, v, *terms, *self.outputs):
            if tv is q or rng.random() < 0.7:
                self._shard(tv)

    def _input(self, shape):
        tv = self.fd.define_tensor(list(shape), dtype=self.dtype)
        full = torch.randn(shape, generator=self.gen, dtype=torch.float64).to(self.dtype.torch)
        self.inputs.append((tv, full))
        return tv

    def _broadcast(self, scores) -> tuple[int, ...]:
        """The scores' shape, some dims 1 (broadcast)."""
        return tuple(1 if self.rng.random() < 0.35 else x for x in scores)

    def _shard(self, tv) -> None:
        """Each mesh axis sharding a distinct dim that its size divides, of the dims attention may keep sharded
        (batch and heads) and, less often, the others (rows, keys, the head dim: resharded first)."""
        rng, mesh = self.rng, self.mesh
        tv.set_device_mesh(mesh)
        split: list[int] = []
        shape = tv.shape
        lead = len(self.qkv[0].shape) - 2
        for axis in reversed(range(mesh.ndim)):
            n = mesh.shape[axis]
            dims = [d for d in range(tv.ndim) if d not in split and shape[d] % n == 0 and shape[d] > 1]
            if rng.random() < 0.75:  # batch or heads where it can
                dims = [d for d in dims if d < lead] or dims
            if not dims or rng.random() < 0.25:
                continue
            d = rng.choice(dims)
            i = next(i for i, ax in enumerate(tv._loop()) if ax.dim == d and not ax.reduction)
            inner = rng.random() < 0.2 and shape[d] > n
            tv.split(i, n, inner_split=inner)
            tv.axis(i + inner).parallelize(ParallelType.for_mesh_axis(axis, mesh.ndim))
            split.append(d)

    def references(self) -> list[torch.Tensor]:
        fulls = {tv.name: full for tv, full in self.inputs}
        q, k, v = (fulls[t.name] for t in self.qkv)
        bias = None if self.bias is None else fulls[self.bias.name]
        mask = None if self.mask is None else fulls[self.mask.name]
        terms = torch.zeros((), dtype=q.dtype) if bias is None else bias
        if mask is not None:
            terms = (terms + torch.where(mask, 0.0, float("-inf"))).to(q.dtype)
        if self.causal:
            causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
            terms = (terms + torch.where(causal, 0.0, float("-inf"))).to(q.dtype)
        lead = q.shape[:-2]
        mask4 = terms.expand(*lead, q.shape[-2], k.shape[-2])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask4, scale=self.scale)
        refs = [out * 2.0 if self.post else out]
        if len(self.outputs) == 2:
            scale = q.shape[-1] ** -0.5 if self.scale is None else self.scale
            scores = torch.matmul(q.double(), k.double().transpose(-2, -1)) * scale + mask4.double()
            refs.append(torch.logsumexp(scores, -1).float())
        return refs


def _run_case(seed: int, rank: int, world: int, mesh: DeviceMesh) -> str:
    case = _AttentionCase(seed, mesh)
    xs = [shard_tensor(full, tv, rank) for tv, full in case.inputs]
    saved = [x.clone() for x in xs]
    text = f"seed {seed} on {mesh}: {case.dtype}, causal {case.causal}, scale {case.scale}\n{case.fd}"
    try:
        outs = case.fd.execute(xs)
    except TPFusionError as e:
        raise AssertionError(f"{text}\nraised {type(e).__name__}: {e}") from e
    text += f"\n{case.fd.plan}"
    for i, (x, x0) in enumerate(zip(xs, saved)):
        assert torch.equal(x, x0), f"input {i} was modified\n{text}"
    refs = case.references()
    atol, rtol = TOL[case.dtype]
    for i, (out, ref, sharding) in enumerate(zip(outs, refs, case.fd.output_shardings())):
        want = shard_tensor(ref, sharding, rank)
        if i == 1:  # the logsumexp: on the rows that attend to some key (a row of none has no defined one)
            rows = want.isfinite()
            assert out.shape == want.shape and out.dtype == want.dtype, f"logsumexp {out.shape} {out.dtype}\n{text}"
            out, want = out[rows], want[rows]
            atol, rtol = max(atol, 1e-5), max(rtol, 1e-5)
        torch.testing.assert_close(out, want, atol=atol, rtol=rtol, msg=lambda m, i=i, t=text: f"output {i}: {m}\n{t}")
        tv = case.outputs[i]
        if tv.mesh is not None and i == 0:  # as scheduled
            asked = shard_tensor(ref, tv, rank)
            assert out.shape == asked.shape, f"output {i}: {list(out.shape)}, scheduled {list(asked.shape)}\n{text}"
    return "ok"


# Cases that found bugs (seed, mesh).
REGRESSIONS_2: list = []
REGRESSIONS_4: list = []

EXAMPLES_2 = examples(40)
EXAMPLES_4 = examples(30)


@pytest.mark.ranks(2)
@ONCE
@given(seeds=seeds(EXAMPLES_2))
def test_attention_with_bias_and_mask_on_a_1d_mesh(multidevice_test, seeds):
    run_cases(_run_case, multidevice_test.rank, multidevice_test.size, with_meshes(seeds, [[0, 1]], REGRESSIONS_2))


@pytest.mark.ranks(4)
@ONCE
@given(seeds=seeds(EXAMPLES_4))
def test_attention_with_bias_and_mask_on_2d_and_1d_meshes(multidevice_test, seeds):
    run_cases(_run_case, multidevice_test.rank, multidevice_test.size, with_meshes(seeds, MESHES_4, REGRESSIONS_4))
