"""Property tests of outputs that alias: the same tensor added as an output twice, an input returned as an output,
views of inputs (reshape, permute, slice, unsqueeze and squeeze, expand, set, a cast to its own dtype) as
outputs, and outputs written into inputs (``add_output(tv, alias_input=)``), in random sharded fusions.

On every rank, after each execute: every returned output equals torch; an input is unchanged unless an output
is written into it, and then it holds that output's values (in its own sharding); no returned output shares
memory with an input, except where the guide says it is that input itself (a plain output of an aliased tensor
or of the input it is written into, where the plan gives it the input's sharding). Then every returned output
is overwritten in place and the fusion runs again on fresh inputs (its cached plan): the results are unchanged,
so no output shares memory with anything the plan keeps.

As in ``test_properties``: hypothesis draws the seeds (derandomized), each rank rebuilds the case from its seed,
the ranks compare outcomes after each case, and a failing case names its seed (replay it with ``_run_case``).
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from property_cases import ONCE, agree, examples, run_cases, seeds, shard_randomly, with_meshes

from tp_fusion import DataType, DeviceMesh, FusionDefinition, TPFusionError, shard_tensor

EXTENTS = (0, 1, 2, 4, 6)
VIEWS = ("reshape", "permute", "slice", "unsqueeze", "expand", "set", "cast", "segment_set")


class _AliasCase:
    """One random fusion whose outputs alias: its definition, full inputs, torch references."""

    def __init__(self, seed: int, mesh: DeviceMesh | None):
        self.rng = rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.mesh = mesh
        self.fd = fd = FusionDefinition()
        self.inputs: list = []  # (tv, full)
        self.refs: dict[int, torch.Tensor] = {}  # tensor name -> its reference value
        self.shape = shape = (rng.choice(EXTENTS), rng.choice(EXTENTS))
        vals = [self._input(shape)]
        if rng.random() < 0.5:
            vals.append(self._input(shape))
        for _ in range(rng.randint(0, 4)):
            vals.append(self._op(rng.choice(vals)))
        # The outputs: some of the values (inputs included), views of them, some twice.
        outs = []
        for _ in range(rng.randint(1, 4)):
            tv = rng.choice(vals)
            if rng.random() < 0.5:
                tv = self._view(tv)
                vals.append(tv)
            outs.append(tv)
            if rng.random() < 0.25:
                outs.append(tv)  # the same tensor twice
        # Outputs written into inputs: a value of an input's shape (an input too), each input written once. Not in
        # chains (an input written into another and written into itself): which value a plain output of it has is
        # not defined then (the guide's rule gives it both, and the library the one aliased last).
        self.aliases: list = []  # (tv, input tv)
        inputs = [tv for tv, _ in self.inputs]
        for _ in range(rng.choice((0, 0, 1, 2))):
            values, targets = {v.name for v, _ in self.aliases}, {i.name for _, i in self.aliases}
            free = [u for u in inputs if u.name not in targets | values]
            if not free:
                break
            target = rng.choice(free)
            fits = [tv for tv in vals if tuple(tv.shape) == shape and tv.name not in values | targets]
            if not fits:
                break
            self.aliases.append((rng.choice(fits), target))
        self.outputs = outs  # returned ones, in order
        order = [(tv, None) for tv in outs]
        for alias in self.aliases:  # aliased outputs before, between or after the plain ones
            order.insert(rng.randint(0, len(order)), alias)
        for tv, target in order:
            if target is None:
                fd.add_output(tv)
            else:
                fd.add_output(tv, alias_input=target)
        if mesh is not None:
            for i, tv in enumerate(vals):
                if i == 0 or rng.random() < (0.7 if i < len(self.inputs) else 0.35):
                    self._shard(tv)

    def _input(self, shape):
        tv = self.fd.define_tensor(list(shape), dtype=DataType.Double)
        full = torch.randn(shape, generator=self.gen, dtype=torch.float64)
        self.inputs.append((tv, full))
        self.refs[tv.name] = full
        return tv

    def _op(self, tv):
        rng, ops = self.rng, self.fd.ops
        x = self.refs[tv.name]
        kind = rng.choice(("relu", "neg", "mul", "add", "view"))
        if kind == "view":
            return self._view(tv)
        if kind == "add":
            others = [u for u, _ in self.inputs if tuple(u.shape) == tuple(tv.shape)]
            u = rng.choice(others) if others else tv
            out, ref = ops.add(tv, u), x + self.refs[u.name]
        elif kind == "mul":
            out, ref = ops.mul(tv, 0.5), x * 0.5
        else:
            out, ref = getattr(ops, kind)(tv), getattr(torch, kind)(x)
        self.refs[out.name] = ref
        return out

    def _view(self, tv):
        rng, ops = self.rng, self.fd.ops
        x = self.refs[tv.name]
        kind = rng.choice(VIEWS)
        if kind == "reshape":
            shape = [x.numel()] if x.dim() > 1 or rng.random() < 0.3 else [1, *x.shape, 1]
            if x.dim() == 2 and rng.random() < 0.5:
                shape = [x.shape[1], x.shape[0]]  # another [b, a] view of [a, b]
            out, ref = ops.reshape(tv, shape), x.reshape(shape)
        elif kind == "permute":
            order = list(range(x.dim()))[::-1]
            out, ref = ops.permute(tv, order), x.permute(order)
        elif kind == "slice":
            d = rng.randrange(x.dim())
            start = rng.randrange(x.shape[d]) if x.shape[d] else 0
            end = rng.randint(start + 1, x.shape[d]) if x.shape[d] else 0
            starts, ends = [0] * x.dim(), list(x.shape)
            starts[d], ends[d] = start, end
            out, ref = ops.slice(tv, starts, ends), x[tuple(slice(s, e) for s, e in zip(starts, ends))]
        elif kind == "unsqueeze":
            d = rng.randrange(x.dim() + 1)
            out = ops.unsqueeze(tv, d)
            ref = x.unsqueeze(d)
            if rng.random() < 0.5:
                out, ref = ops.squeeze(out, [d]), ref.squeeze(d)
        elif kind == "expand":  # a new leading dim
            e = rng.choice((1, 2, 3))
            out = ops.broadcast_in_dim(tv, [e, *x.shape], list(range(1, x.dim() + 1)))
            ref = x.unsqueeze(0).expand(e, *x.shape)
        elif kind == "cast":
            out, ref = ops.cast(tv, DataType.Double), x
        else:
            out, ref = getattr(ops, kind)(tv), x
        self.refs[out.name] = ref
        return out

    def _shard(self, tv) -> None:
        """On the mesh: replicated, or each mesh axis sharding a distinct dim its size divides (an outer or an
        inner piece of a split)."""
        shard_randomly(tv, self.mesh, self.rng)


def _shard(full, tv_or_sharding, rank: int) -> torch.Tensor:
    """A rank's shard of ``full`` (a copy: an input may be written into); all of it without meshes."""
    return full.clone() if tv_or_sharding is None else shard_tensor(full, tv_or_sharding, rank).clone()


def _storages(ts) -> dict[int, int]:
    """The storage of each tensor that has elements, by its position."""
    return {i: t.untyped_storage().data_ptr() for i, t in enumerate(ts) if t.numel()}


def _run_case(seed: int, rank: int, world: int, mesh: DeviceMesh | None) -> None:
    case = _AliasCase(seed, mesh)
    fd = case.fd
    text = f"seed {seed} on {mesh}\n{fd}"
    written = {target.name: value for value, target in case.aliases}
    for run in range(2):
        xs = [_shard(full, tv if mesh is not None else None, rank) for tv, full in case.inputs]
        saved = [x.clone() for x in xs]
        try:
            outs = fd.execute(xs)
        except TPFusionError as e:
            raise AssertionError(f"{text}\nrun {run} raised {type(e).__name__}: {e}") from e
        text = f"seed {seed} on {mesh}, run {run}\n{fd}\n{fd.plan}"
        assert len(outs) == len(case.outputs), f"{len(outs)} outputs returned\n{text}"
        # The inputs: unchanged, or holding what was written into them.
        for i, ((tv, _), x, x0) in enumerate(zip(case.inputs, xs, saved)):
            if tv.name in written:
                want = _shard(case.refs[written[tv.name].name], tv if mesh is not None else None, rank)
                torch.testing.assert_close(x, want, rtol=1e-7, atol=1e-9,
                                           msg=lambda m, i=i, t=text: f"input {i} written: {m}\n{t}")
            else:
                assert torch.equal(x, x0), f"input {i} was modified\n{text}"
        # The outputs: torch's values (a plain output of an input written into holds the values written, unless
        # that input is itself written into another: then it is the other, holding its values).
        shardings = fd.output_shardings()
        for i, (out, tv, sharding) in enumerate(zip(outs, case.outputs, shardings)):
            new = tv.name in written and tv.name not in {v.name for v, _ in case.aliases}
            ref = case.refs[written[tv.name].name] if new else case.refs[tv.name]
            torch.testing.assert_close(out, _shard(ref, sharding if mesh is not None else None, rank),
                                       rtol=1e-7, atol=1e-9, msg=lambda m, i=i, t=text: f"output {i}: {m}\n{t}")
        # Memory: an output shares an input's only where it is that input, itself an alias target, and the output
        # is the input or the tensor written into it.
        held = _storages(xs)
        for i, ptr in _storages(outs).items():
            shared = [j for j, p in held.items() if p == ptr]
            if not shared:
                continue
            (j,) = shared
            tv, target = case.outputs[i], case.inputs[j][0]
            allowed = target.name in written and (tv.name == target.name or tv.name == written[target.name].name)
            assert allowed and outs[i] is xs[j], f"output {i} shares the memory of input {j}\n{text}"
        # Overwrite every returned output that is no input: the next run must not see it.
        for out in outs:
            if not any(out is x for x in xs):
                out.fill_(1e6)
    agree("ok", text)


MESHES_2 = [[0, 1], [0, 1], [0, 1], None]  # None: a fusion without meshes, on each rank alone
MESHES_4 = [[[0, 1], [2, 3]], [0, 1, 2, 3], [[0, 2], [1, 3]], [0, 1, 2, 3], None]

# Cases that found bugs (seed, mesh).
REGRESSIONS_2: list = []
REGRESSIONS_4: list = []

EXAMPLES_2 = examples(40)
EXAMPLES_4 = examples(25)


@pytest.mark.ranks(2)
@ONCE
@given(seeds=seeds(EXAMPLES_2))
def test_aliased_outputs_on_a_1d_mesh(multidevice_test, seeds):
    run_cases(_run_case, multidevice_test.rank, multidevice_test.size, with_meshes(seeds, MESHES_2, REGRESSIONS_2))


@pytest.mark.ranks(4)
@ONCE
@given(seeds=seeds(EXAMPLES_4))
def test_aliased_outputs_on_2d_and_1d_meshes(multidevice_test, seeds):
    run_cases(_run_case, multidevice_test.rank, multidevice_test.size, with_meshes(seeds, MESHES_4, REGRESSIONS_4))
