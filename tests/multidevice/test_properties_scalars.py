"""Property tests of scalar inputs (``fd.define_scalar(None, dtype)``, passed to ``execute`` as Python numbers):
random sharded fusions that take scalars as operands of pointwise ops (alone or through ops on scalars) and as
the value attributes ops read at every call (``OpDef.value_attrs``: ``full``'s fill value, ``clamp``'s bounds,
``threshold``'s threshold and value, ``addcmul``'s value, ``uniform``'s and ``normal``'s range and seeds), and
now and then as an extent a plan is built for (a reshape's). Each fusion runs several times with other numbers
(some repeated) on every rank: each call equals torch computed with that call's numbers, and the numbers read at
every call build no new plan; a number torch refuses (an extent that does not divide, an index out of range) raises
a ValueError on every rank before anything runs.

As in ``test_properties``: hypothesis draws the seeds (derandomized), each rank rebuilds the case from its seed,
the ranks compare outcomes after each call, and a failing case names its seed (replay it with ``_run_case``).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from property_cases import MESHES_4, ONCE, agree, examples, run_cases, seeds, shard_randomly, with_meshes

from tp_fusion import DataType, DeviceMesh, FusionDefinition, TPFusionError, shard_tensor

EXTENTS = (2, 4, 6, 8)
FLOATS = (-1.5, -0.5, 0.0, 0.25, 1.0, 2.0, 3.5)  # exact in float32: a Float scalar reads them alike
NUMBERS = (*FLOATS, 2, -1)  # a floating scalar's numbers: ints too (execute takes an int for a float)
INTS = (-3, -1, 0, 1, 2, 5)
SEEDS = (0, 1, 7, 123, 4096)
OFFSETS = (0, 4, 8, 12)
POINTWISE = {"add": torch.add, "sub": torch.sub, "mul": torch.mul}


class _ScalarCase:
    """One random fusion of one or two tensors and some scalar inputs. ``steps`` rebuild the torch reference from
    the full inputs and a call's numbers (by scalar name)."""

    def __init__(self, seed: int, mesh: DeviceMesh):
        self.rng = rng = random.Random(seed)
        self.seed, self.mesh = seed, mesh
        self.fd = fd = FusionDefinition()
        self.inputs: list = []  # (tv, full) for tensors, (scalar, kind) for scalars; in definition order
        self.scalars: dict[int, tuple] = {}  # name -> (DataType, the values a call draws from)
        self.steps: list = []  # (name, fn(env, numbers) -> reference)
        self.shapes: dict[int, tuple] = {}
        self.bound: list[int] = []  # scalars a plan is built for (a reshape's extent)
        self.shape = (rng.choice(EXTENTS), rng.choice(EXTENTS))
        vals = [self._tensor(self.shape)]
        for _ in range(rng.randint(1, 5)):
            vals.append(self._op(rng.choice(vals[-2:])))
        outs = [vals[-1]]
        if len(vals) > 2 and rng.random() < 0.5:
            outs.append(rng.choice(vals[1:-1]))
        for tv in outs:
            fd.add_output(tv)
        self.outputs = outs
        for i, tv in enumerate(vals):
            if i == 0 or rng.random() < 0.5:
                self._shard(tv)
        for tv, _ in self.inputs:
            if tv.is_tensor() and tv.mesh is None and rng.random() < 0.6:
                self._shard(tv)

    # --- the math ------------------------------------------------------------------------------

    def _tensor(self, shape):
        tv = self.fd.define_tensor(list(shape), dtype=DataType.Double)
        gen = torch.Generator().manual_seed(self.seed * 7 + len(self.inputs))
        self.inputs.append((tv, torch.randn(shape, generator=gen, dtype=torch.float64)))
        self.shapes[tv.name] = tuple(shape)
        return tv

    def _scalar(self, kind: str = "float"):
        """A scalar input: a Double, Float or Int number for an operand or a bound ("float"), an Int seed or
        offset, a positive std."""
        dtype = {"float": self.rng.choice((DataType.Double, DataType.Double, DataType.Float, DataType.Int)),
                 "seed": DataType.Int, "offset": DataType.Int, "std": DataType.Double}[kind]
        values = {"seed": SEEDS, "offset": OFFSETS, "std": (0.5, 1.0, 2.0)}.get(kind)
        if values is None:
            values = INTS if dtype == DataType.Int else NUMBERS
        s = self.fd.define_scalar(None, dtype=dtype)
        self.inputs.append((s, None))
        self.scalars[s.name] = (dtype, values)
        return s

    def _number(self, kind: str = "float"):
        """A number for an op: a scalar input (most often), an op on scalar inputs, or a Python number. Returns
        (what the op takes, fn(numbers) -> its value as torch reads it)."""
        rng, ops = self.rng, self.fd.ops
        r = rng.random()
        if r < 0.15 and kind == "float":
            c = rng.choice(FLOATS)
            return c, lambda nums: c
        s = self._scalar(kind)
        a = s.name
        if r < 0.35 and kind in ("float", "seed"):  # an op on scalars: a scalar too
            if kind == "seed":
                return ops.add(s, 1), lambda nums: nums[a] + 1
            t = self._scalar()
            b = t.name
            how = rng.choice(("add", "mul", "sub"))
            fold = {"add": lambda x, y: x + y, "mul": lambda x, y: x * y, "sub": lambda x, y: x - y}[how]
            return getattr(ops, how)(s, t), lambda nums: (fold(self._as_tensor(a, nums), self._as_tensor(b, nums))
                                                          .item())
        return s, lambda nums: self._as_tensor(a, nums).item()

    def _operand(self, value, taken, nums: dict):
        """A number as an operand takes it: a scalar (input or op on them) as a 0-d tensor of its dtype, a Python
        number as it is."""
        if isinstance(taken, float):
            return taken
        return torch.tensor(value(nums), dtype=taken.dtype.torch)

    def _as_tensor(self, name: int, nums: dict) -> torch.Tensor:
        """A scalar's number as the 0-d tensor of its dtype that ops take (torch promotes it as one)."""
        return torch.tensor(nums[name], dtype=self.scalars[name][0].torch)

    def _step(self, tv, fn):
        self.steps.append((tv.name, fn))
        return tv

    def _op(self, tv):
        rng = self.rng
        shape = self.shapes.get(tv.name)  # None: extents a scalar gives (a reshape's), known per call
        kinds = ("operand", "operand", "clamp", "threshold", "where", "pow", "extremum")
        if shape is not None:
            kinds += ("full", "addcmul", "uniform", "normal", "lerp", "linear", "linear",
                      *(("reshape", "select") if not self.bound else ()))
        kind = rng.choice(kinds)
        out = self._kind(kind, tv, shape)
        if kind not in ("reshape", "select") and out.name not in self.shapes:
            self.shapes[out.name] = shape
        return out

    def _kind(self, kind: str, tv, shape):
        rng, ops = self.rng, self.fd.ops
        a = tv.name
        if kind == "operand":  # x op s, s op x, or x / s (s never 0 there: 1 + s^2)
            name = rng.choice((*sorted(POINTWISE), "div"))
            s = self._scalar()
            b = s.name
            if name == "div":
                denom = ops.add(ops.mul(s, s), 1.0)
                return self._step(ops.div(tv, denom),
                                  lambda env, nums: env[a] / (self._as_tensor(b, nums) ** 2 + 1.0))
            if rng.random() < 0.5:
                return self._step(getattr(ops, name)(tv, s),
                                  lambda env, nums: POINTWISE[name](env[a], self._as_tensor(b, nums)))
            return self._step(getattr(ops, name)(s, tv),
                              lambda env, nums: POINTWISE[name](self._as_tensor(b, nums), env[a]))
        if kind == "where":  # where(x > s, x, t): a scalar compared, a scalar selected
            (c, cval), (t, tval) = self._number(), self._number()
            return self._step(ops.where(ops.gt(tv, c), tv, t),
                              lambda env, nums: torch.where(env[a] > self._operand(cval, c, nums), env[a],
                                                            self._operand(tval, t, nums)))
        if kind == "pow":  # (|x| + 1) ** s
            s = self._scalar()
            b = s.name
            return self._step(ops.pow(ops.add(ops.abs(tv), 1.0), s),
                              lambda env, nums: torch.pow(env[a].abs() + 1.0, self._as_tensor(b, nums)))
        if kind == "extremum":
            name = rng.choice(("maximum", "minimum"))
            s = self._scalar()
            b = s.name
            fn = getattr(torch, name)
            return self._step(getattr(ops, name)(tv, s), lambda env, nums: fn(env[a], self._as_tensor(b, nums)))
        if kind == "lerp":  # lerp(x, y, s): the weight a scalar operand
            y = self._tensor(shape)
            s = self._scalar()
            b, c = y.name, s.name
            return self._shaped(ops.lerp(tv, y, s), shape,
                                lambda env, nums: torch.lerp(env[a], env[b], self._as_tensor(c, nums).double()))
        if kind == "linear":  # a GEMM (fused with its collective where sharded so) for the scalars' ops to follow
            n = rng.choice(EXTENTS)
            w = self._tensor((n, shape[-1]))
            b = w.name
            if rng.random() < 0.5:
                bias = self._tensor((n,))
                c = bias.name
                out = ops.linear(tv, w, bias)
                if rng.random() < 0.5:  # bias and GELU in the GEMM's epilogue
                    return self._shaped(ops.gelu(out, approximate="tanh"), (shape[0], n),
                                        lambda env, nums: F.gelu(F.linear(env[a], env[b], env[c]), approximate="tanh"))
                return self._shaped(out, (shape[0], n), lambda env, nums: F.linear(env[a], env[b], env[c]))
            return self._shaped(ops.linear(tv, w), (shape[0], n), lambda env, nums: F.linear(env[a], env[b]))
        if kind == "full":  # x + full(x's shape, fill)
            fill, value = self._number()
            filled = ops.full(list(shape), fill, DataType.Double)
            self.shapes[filled.name] = shape
            return self._shaped(ops.add(tv, filled), shape, lambda env, nums: env[a] + value(nums))
        if kind == "clamp":
            which = rng.choice(("min", "max", "both"))
            lo = self._number() if which != "max" else (None, lambda nums: None)
            hi = self._number() if which != "min" else (None, lambda nums: None)
            out = ops.clamp(tv, min=lo[0], max=hi[0])
            return self._step(out, lambda env, nums: torch.clamp(env[a], lo[1](nums), hi[1](nums)))
        if kind == "threshold":
            (t, tval), (v, vval) = self._number(), self._number()
            return self._step(ops.threshold(tv, t, v),
                              lambda env, nums: F.threshold(env[a], tval(nums), vval(nums)))
        if kind == "addcmul":
            y = self._tensor(shape)
            b = y.name
            value, vval = self._number()
            return self._shaped(ops.addcmul(tv, y, tv, value=value), shape,
                              lambda env, nums: torch.addcmul(env[a], env[b], env[a], value=vval(nums)))
        if kind in ("uniform", "normal"):  # x + a draw of x's shape
            seed, sval = self._number("seed")
            offset, oval = self._number("offset")
            if kind == "uniform":
                (lo, loval), (hi, hival) = self._number(), self._number()
                if isinstance(lo, float) and isinstance(hi, float) and lo > hi:  # numbers written in: low <= high
                    (lo, loval), (hi, hival) = (hi, hival), (lo, loval)
                drawn = ops.uniform(lo, hi, list(shape), rng_seed=seed, rng_offset=offset, dtype=DataType.Double)
            else:
                (lo, loval), (hi, hival) = self._number(), self._number("std")
                drawn = ops.normal(lo, hi, list(shape), rng_seed=seed, rng_offset=offset, dtype=DataType.Double)
            self.shapes[drawn.name] = shape
            d = drawn.name
            self.steps.append((d, lambda env, nums: _whole_draw(kind, loval(nums), hival(nums), shape, sval(nums),
                                                                oval(nums))))
            return self._shaped(ops.add(tv, drawn), shape, lambda env, nums: env[a] + env[d])
        if kind == "select":  # an index from a scalar: a plan per value (out of range: an invalid call)
            d = rng.randrange(2)
            index = self.fd.define_scalar(None, dtype=DataType.Int)
            self.inputs.append((index, None))
            self.scalars[index.name] = (DataType.Int, tuple(range(-shape[d] - 1, shape[d] + 1)))
            self.bound.append(index.name)
            i = index.name
            return self._step(ops.select(tv, index, d), lambda env, nums: env[a].select(d, nums[i]))
        if kind == "reshape":  # an extent from a scalar: a plan per value; the same scalar as an operand too
            rows = self.fd.define_scalar(None, dtype=DataType.Int)
            n = shape[0] * shape[1]
            self.inputs.append((rows, None))
            # (now and then one that does not divide, or 0: an invalid call, which must raise before running)
            self.scalars[rows.name] = (DataType.Int, (*(r for r in (1, 2, 4, 8, 3, 6) if n % r == 0), -1, 5, 0))
            self.bound.append(rows.name)
            r = rows.name
            out = ops.mul(ops.reshape(tv, [rows, -1]), rows)
            return self._step(out, lambda env, nums: env[a].reshape(nums[r], -1) * nums[r])
        raise AssertionError(kind)

    def _shaped(self, tv, shape, fn):
        self.shapes[tv.name] = shape
        return self._step(tv, fn)

    # --- the schedule --------------------------------------------------------------------------

    def _shard(self, tv) -> None:
        """On the mesh: replicated, or each mesh axis sharding a distinct dim that its size divides (an outer or
        an inner piece). A tensor a scalar reshaped (its extents known only per call) is left replicated."""
        if any(e < 0 for e in tv.shape):
            tv.set_device_mesh(self.mesh)
        else:
            shard_randomly(tv, self.mesh, self.rng)

    # --- the calls -----------------------------------------------------------------------------

    def draw_numbers(self) -> dict[int, object]:
        return {name: self.rng.choice(values) for name, (_, values) in self.scalars.items()}

    def call_inputs(self, nums: dict, rank: int) -> list:
        """A call's inputs: this rank's shards, and the numbers (now and then as 0-d tensors of their dtypes)."""
        as_tensors = self.rng.random() < 0.15
        return [(torch.tensor(nums[x.name], dtype=x.dtype.torch) if as_tensors else nums[x.name]) if full is None
                else shard_tensor(full, x, rank) for x, full in self.inputs]

    def references(self, nums: dict) -> list[torch.Tensor]:
        env = {x.name: full for x, full in self.inputs if full is not None}
        for name, fn in self.steps:
            env[name] = fn(env, nums)
        return [env[tv.name] for tv in self.outputs]


def _whole_draw(kind: str, a, b, shape, seed: int, offset: int) -> torch.Tensor:
    """The unsharded draw of these numbers: uniform's in [0, 1) or normal's of mean 0 and std 1 from a fusion
    without meshes that has the seed and offset written in, scaled as torch would (a range from scalars may be
    empty or reversed: uniform(low, high) is low + (high - low) * u, whatever their order)."""
    with FusionDefinition() as fd:
        factory = fd.ops.uniform if kind == "uniform" else fd.ops.normal
        fd.add_output(factory(0, 1, list(shape), rng_seed=seed, rng_offset=offset, dtype=DataType.Double))
    unit = fd.execute([])[0]
    return unit * (b - a) + a if kind == "uniform" else unit * b + a


def _run_case(seed: int, rank: int, world: int, mesh: DeviceMesh, calls: int = 4) -> list[str]:
    """Build one case and execute it ``calls`` times with drawn numbers (some repeated); checks each call, and
    that the fusion built one plan per value of the scalars that plans are built for."""
    case = _ScalarCase(seed, mesh)
    drawn: list[dict] = []
    outcomes = []
    for call in range(calls):
        nums = case.rng.choice(drawn) if drawn and case.rng.random() < 0.25 else case.draw_numbers()
        drawn.append(nums)
        xs = case.call_inputs(nums, rank)
        saved = [x.clone() if isinstance(x, torch.Tensor) else x for x in xs]
        text = f"seed {seed} on {mesh}, call {call}, numbers {nums}\n{case.fd}"
        try:
            refs = case.references(nums)
        except (RuntimeError, IndexError) as e:  # torch refuses these numbers (an extent, an index): so must execute
            refs, refused = None, e
        try:
            outs = case.fd.execute(xs)
        except TPFusionError as e:
            assert refs is None, f"{text}\nraised {type(e).__name__}: {e}"
            # before anything runs (a ValueError), not inside the plan (an ExecutionError)
            assert isinstance(e, ValueError), f"{text}\ntorch refuses ({refused}); execute raised {e!r}"
            outcomes.append(type(e).__name__)
            agree(outcomes[-1], text, exact=False)
            continue
        assert refs is not None, f"{text}\nran, though torch refuses: {refused}\n{case.fd.plan}"
        text += f"\n{case.fd.plan}"
        for i, (x, x0) in enumerate(zip(xs, saved)):
            assert not isinstance(x, torch.Tensor) or torch.equal(x, x0), f"input {i} was modified\n{text}"
        assert len(outs) == len(refs), text
        for i, (out, ref, sharding) in enumerate(zip(outs, refs, case.fd.output_shardings())):
            torch.testing.assert_close(out, shard_tensor(ref, sharding, rank), rtol=1e-7, atol=1e-9,
                                       msg=lambda m, i=i, t=text: f"output {i}: {m}\n{t}")
        outcomes.append("ok")
        agree("ok", text, exact=False)
    plans = len({tuple(nums[r] for r in case.bound) for nums, outcome in zip(drawn, outcomes) if outcome == "ok"})
    assert len(case.fd._executor._cache) == plans, \
        f"seed {seed}: {len(case.fd._executor._cache)} plans for {plans} value(s) of the bound scalars\n{case.fd}"
    return outcomes


# Cases that found bugs (seed, mesh): a select's index from a scalar input out of range (1: it failed inside the plan,
# an ExecutionError, where execute checks it before running now).
REGRESSIONS_2: list = [(1, [0, 1])]
REGRESSIONS_4: list = []

EXAMPLES_2 = examples(25)
EXAMPLES_4 = examples(15)


@pytest.mark.ranks(2)
@ONCE
@given(seeds=seeds(EXAMPLES_2))
def test_scalar_inputs_read_per_call_on_a_1d_mesh(multidevice_test, seeds):
    run_cases(_run_case, multidevice_test.rank, multidevice_test.size, with_meshes(seeds, [[0, 1]], REGRESSIONS_2))


@pytest.mark.ranks(4)
@ONCE
@given(seeds=seeds(EXAMPLES_4))
def test_scalar_inputs_read_per_call_on_2d_and_1d_meshes(multidevice_test, seeds):
    run_cases(_run_case, multidevice_test.rank, multidevice_test.size, with_meshes(seeds, MESHES_4, REGRESSIONS_4))
