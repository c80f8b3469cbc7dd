"""The thin runner: executes a ``Program`` on this rank's local shards.

``Runner(program)`` resolves the program's process groups (every rank creates every group, in
program order) and turns each instruction into a closure once; ``run(inputs)`` calls them under
``torch.no_grad`` (execute is forward only) and returns this rank's outputs. A fused segment runs
its ``FusedGemm`` in the mode tuning recorded. A failure inside a segment is reported through
``tp_fusion.runtime.faults`` so that every rank fails promptly, naming the rank that failed first.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable

import torch
from tp_fusion.sharding.reshard import Collective

from tp_fusion.errors import ExecutionError
from tp_fusion.ir import resolve_symbols, symbols_of
from tp_fusion.ops import OPS, Trait, is_tanh_gelu, on_broadcast_base, take_seed, with_stride_order
from tp_fusion.program import (
    FUSED,
    SEQUENTIAL,
    Communicate,
    Compute,
    FusedGemm,
    Program,
    ProgramSegment,
)
from tp_fusion.runtime import collectives, dist, faults, graphs, overlap, regions

Env = dict[int, torch.Tensor]


class Runner:
    def __init__(self, program: Program):
        self.program = program
        self.world = dist.world_token()  # the process group the runner was built under
        self._multirank = program.fusion.has_meshes and dist.is_initialized() and dist.world_size() > 1
        for ranks in program.groups():
            dist.group(ranks)
        self._regions = regions.mode()
        self._readers = _readers(program) if self._regions else {}
        self._on_broadcasts = _on_broadcasts(program)
        units = [self._segment(seg) for seg in program.segments]
        self._runs = [_in_order(seg_units, drops) for seg_units, drops in zip(units, _drops(program, units))]
        # Asynchronous collectives (Program.overlapped): what to issue after each segment (-1: at the
        # start), in the order they are awaited, and what to await before each (len: at the end).
        # segment -> (start, its input, its output)
        self._async = {i: (collectives.step_fn(step, program, async_op=True) if step.runs_here else _nothing,
                           step.op.inputs[0], step.op.outputs[0])
                       for i in program.overlapped for step in program.segments[i].steps}
        self._issue_after: dict[int, list[int]] = {}
        self._await_before: dict[int, list[int]] = {}
        for i, (issue, wait) in sorted(program.overlapped.items(), key=lambda kv: (kv[1][1], kv[0])):
            self._issue_after.setdefault(issue, []).append(i)
            self._await_before.setdefault(wait, []).append(i)
        self.graph: graphs.GraphedRun | None = None

    # --- building --------------------------------------------------------------------------------

    def _segment(self, seg: ProgramSegment) -> list[tuple[Callable[[Env], None], tuple[int, ...]]]:
        """The segment's units, run in order: (``run(env)``, the values it reads or writes)."""
        if seg.fused is not None and seg.fused.runs_here and seg.fused.mode != SEQUENTIAL:
            f = seg.fused
            operands = tuple(a for a in (f.x, f.weight, f.bias, f.residual, f.out) if a is not None)
            return [(_fused(f, self.program), _values(*seg.steps) + operands)]
        steps = []
        pairs = self.program.gelu_pairs(seg)
        fused_away = {id(seg.steps[j + 1]) for j in pairs}
        gemms = {id(seg.steps[j]): (seg.steps[j + 1], in_gemm) for j, in_gemm in pairs.items()}
        for in_region, run_steps in regions.split(seg.steps, _not_in(fused_away)) if self._regions \
                else [(False, seg.steps)]:
            if in_region:
                inside = {id(s) for s in run_steps}

                def read_later(value, inside=inside) -> bool:
                    return bool(self._readers.get(value, set()) - inside)
                steps.append((regions.region(run_steps, read_later, self._regions), _values(*run_steps)))
            else:
                steps.extend((_gemm_gelu(s, *gemms[id(s)]), _values(s, gemms[id(s)][0])) if id(s) in gemms
                             else (self._step(s), _values(s)) for s in run_steps if id(s) not in fused_away)
        return steps

    def _step(self, s: Compute | Communicate) -> Callable[[Env], None]:
        if not s.runs_here:
            od = OPS[s.op.kind]
            if od.fresh_seed is not None and od.fresh_seed(dict(s.attrs)):
                return lambda env: take_seed()  # as the ranks that run it do: later unseeded draws stay alike
            return lambda env: None
        if isinstance(s, Communicate):
            fn = collectives.step_fn(s, self.program)
            name, out = s.op.inputs[0], s.op.outputs[0]

            def run_step(env):
                result = fn(env.get(name))
                if result is not None:
                    env[out] = result
            return run_step
        kind, attrs, outs = s.op.kind, _attrs_per_call(dict(s.attrs)), s.op.outputs
        operands = [(a, False) if isinstance(a, int) else (a.value, True) for a in s.op.inputs]

        def args(env):
            return [v if const else env[v] for v, const in operands]
        # The implementation is looked up per call, so a test can swap it (fault injection). A pointwise op
        # whose operands may all be broadcasts along a dim keeps them so (``on_broadcast_base``), as nvFuser
        # does. An error names the op.
        on_base, op = s.op.outputs[0] in self._on_broadcasts, s.op

        def call(env):
            try:
                if on_base:
                    return on_broadcast_base(OPS[kind].impl, args(env), attrs(env))
                return OPS[kind].impl(*args(env), **attrs(env))
            except Exception as e:
                _blame(e, op)
                raise
        if len(outs) == 1:
            (out,) = outs

            def run_one(env):
                env[out] = call(env)
            return run_one

        def run_many(env):
            for o, r in zip(outs, call(env)):
                env[o] = r
        return run_many

    # --- running ---------------------------------------------------------------------------------

    def run(self, inputs: list[torch.Tensor], numbers: dict | None = None) -> list[torch.Tensor]:
        """This rank's outputs (replayed from a CUDA graph where the program says so). ``numbers``: this
        call's numbers of the value attributes that scalar inputs give (``Program.numbers``)."""
        with torch.no_grad():
            if self.graph is None:
                return self.run_eager(inputs, numbers)
            if self.graph.alive:  # (an op whose attributes each call gives is not captured: OpDef.capturable)
                return self.graph.replay(inputs)
            # Released (before the process group goes) or not capturable again on this rank: eagerly, on
            # the graphs' own mailboxes, which the peers' replays use and keep the phases of.
            with self.graph.mailboxes:
                return self.run_eager(inputs, numbers)

    def run_eager(self, inputs: list[torch.Tensor], numbers: dict | None = None,
                  report_faults: bool = True) -> list[torch.Tensor]:
        """This rank's outputs, launched op by op. ``report_faults=False`` (tuning's graph capture)
        lets an error through as it is, without telling the peers or aborting the process group."""
        program = self.program
        env: Env = dict(zip(program.fusion.inputs, inputs))
        env.update(numbers or {})  # keyed by their ScalarRef, read by ``_attrs_per_call``
        # Under a CUDA-graph capture every collective runs in program order on the captured stream
        # (asynchronous collectives were not tried inside a capture).
        overlapping = bool(self._async) and not (program.device.type == "cuda"
                                                 and torch.cuda.is_current_stream_capturing())
        pending: dict[int, Callable[[], torch.Tensor]] = {}
        if overlapping:
            self._issue(-1, env, pending, report_faults)
        for i, run in enumerate(self._runs):
            if overlapping:
                self._await(i, env, pending, report_faults)
                if i in self._async:
                    continue
            self._in_segment(i, lambda run=run: run(env), report_faults)
            if overlapping:
                self._issue(i, env, pending, report_faults)
        if overlapping:
            self._await(len(self._runs), env, pending, report_faults)
        input_storages = {x.untyped_storage().data_ptr() for x in inputs if isinstance(x, torch.Tensor)}
        outs = []
        for o, held in program.outputs:
            if not held:  # this rank holds no part of this output
                outs.append(torch.empty((0,), dtype=program.fusion.tensor(o).dtype.torch, device=program.device))
                continue
            x, order = env[o], program.fusion.tensor(o).stride_order  # its layout (compile.resolve_layouts)
            laid_out = x.contiguous() if order is None else with_stride_order(x, order)
            if laid_out.untyped_storage().data_ptr() in input_storages or any(laid_out is y for y in outs):
                laid_out = laid_out.clone()  # keeps the layout; an output added twice comes back twice
            outs.append(laid_out)
        return outs

    def _issue(self, after: int, env: Env, pending: dict, report_faults: bool) -> None:
        """Start the asynchronous collectives scheduled after segment ``after``."""
        for j in self._issue_after.get(after, ()):
            start, x, _ = self._async[j]
            pending[j] = self._in_segment(j, lambda start=start, x=x: start(env.get(x)), report_faults)

    def _await(self, before: int, env: Env, pending: dict, report_faults: bool) -> None:
        """Wait for the asynchronous collectives whose results segment ``before`` reads (or the outputs)."""
        for j in self._await_before.get(before, ()):
            finish = pending.pop(j)
            if finish is not None:
                env[self._async[j][2]] = self._in_segment(j, finish, report_faults)

    def _in_segment(self, i: int, fn: Callable[[], object], report_faults: bool):
        """``fn()``, a part of segment ``i``; a failure is reported as that segment's (see ``faults``)."""
        try:
            return fn()
        except BaseException as e:
            if isinstance(e, ExecutionError) or not report_faults:
                raise
            seg = self.program.segments[i]
            where = f"segment {i} ({seg.kind}{' ' + seg.note if seg.note else ''})"
            message = self._failure(where, e, local=seg.kind == "compute")
            if not isinstance(e, Exception):  # KeyboardInterrupt & co.: the peers are told, then it goes on
                raise
            raise ExecutionError(message) from e

    def _failure(self, where: str, e: BaseException, local: bool) -> str:
        error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:400] if str(e).strip() else ''}"
        if getattr(e, "tp_fusion_op", None) is not None:
            error += f" (at {e.tp_fusion_op})"
        if not self._multirank:
            return f"rank {self.program.rank} failed in {where}: {error}"
        return faults.report_failure(self.program.rank, where, error, local=local or not isinstance(e, RuntimeError),
                                     exc=e)


def _blame(e: Exception, op) -> None:
    """Mark ``e`` as raised by the step of ``op``, whose text the failure's message then ends with (where
    aten's own says only ``ZeroDivisionError``, say)."""
    if getattr(e, "tp_fusion_op", None) is None:
        try:
            e.tp_fusion_op = str(op)
        except AttributeError:  # an exception type that takes no attributes
            pass


def _on_broadcasts(program: Program) -> set[int]:
    """The results of pointwise steps whose tensor operands may all be broadcasts along some dim of extent
    over 1 (``on_broadcast_base`` then checks their strides at run time; every other step calls its op
    directly, as that check costs host time on every call). A dim may be a broadcast where
    ``broadcast_in_dim`` expands it, or where a pointwise step's operands may all be broadcasts along it;
    an extent of 1 is one. Extents are the fusion's global ones: a dim cut to one element per rank is
    missed, never taken for a broadcast it is not."""
    shape_of = program.fusion.tensor
    expanded: dict[int, frozenset[int]] = {}  # value -> the dims it may hold expanded (stride 0)
    candidates: set[int] = set()
    steps = (s for seg in program.segments for s in seg.steps if isinstance(s, Compute) and s.runs_here)
    for s in steps:
        op, out = s.op, s.op.outputs[0]
        out_shape = shape_of(out).shape
        if op.kind == "broadcast_in_dim":  # a new dim, or one of extent 1 made longer, is expanded
            x = op.inputs[0]
            source = {d: i for i, d in enumerate(dict(s.attrs)["broadcast_dims"])}
            expanded[out] = frozenset(d for d in range(len(out_shape)) if out_shape[d] != 1 and (
                d not in source or shape_of(x).shape[source[d]] == 1 or source[d] in expanded.get(x, ())))
        elif OPS[op.kind].has(Trait.POINTWISE) and len(op.outputs) == 1:
            operands = [a for a in op.inputs if isinstance(a, int) and shape_of(a).shape]
            dims = frozenset(d for d in range(len(out_shape))
                             if out_shape[d] != 1 and all(_may_broadcast(shape_of(a).shape, expanded.get(a, ()),
                                                                         d - len(out_shape)) for a in operands))
            if dims and operands:
                expanded[out] = dims
                candidates.add(out)
    return candidates


def _may_broadcast(shape: tuple[int, ...], expanded, d: int) -> bool:
    """Whether an operand of ``shape`` (its dims in ``expanded`` may be expanded) is a broadcast along the
    result's dim ``d`` (counted from the end, as torch aligns operands)."""
    e = d + len(shape)
    return e < 0 or shape[e] == 1 or e in expanded


def _values(*steps: Compute | Communicate) -> tuple[int, ...]:
    """The values ``steps`` read or write (by name)."""
    return tuple(a for s in steps for a in (*s.op.inputs, *s.op.outputs) if isinstance(a, int))


def _drops(program: Program, units: list[list[tuple[Callable, tuple[int, ...]]]]) -> list[list[tuple[int, ...]]]:
    """Per segment, per unit: the values to drop from the environment once the unit has run, as nothing after
    it reads them (their last use; never the fusion's inputs or the program's outputs). A value held to the end
    of the call would keep every intermediate alive at once: torch frees a tensor when its last reader is done,
    and so does the runner. An asynchronous collective's values (``Program.overlapped``) count as used where it
    is awaited (its input is read until then); one awaited at the end keeps its values to the end."""
    n, first = len(units), [0]  # the position of each segment's first unit; first[n]: the end
    for seg_units in units:
        first.append(first[-1] + len(seg_units))
    end = first[n]
    last: dict[int, int] = {}
    for i, seg_units in enumerate(units):
        for k, (_, names) in enumerate(seg_units):
            at = first[i] + k
            if i in program.overlapped:
                wait = program.overlapped[i][1]
                at = max(at, first[wait]) if wait < n else end
            for name in names:
                last[name] = max(last.get(name, at), at)
    kept = {o for o, _ in program.outputs} | set(program.fusion.inputs)
    drops = [[[] for _ in seg_units] for seg_units in units]
    for name, at in last.items():
        if name in kept or at >= end:
            continue
        i = bisect.bisect_right(first, at) - 1  # the segment whose units include position ``at``
        drops[i][at - first[i]].append(name)
    return [[tuple(d) for d in seg_drops] for seg_drops in drops]


def _in_order(units: list[tuple[Callable[[Env], None], tuple[int, ...]]],
              drops: list[tuple[int, ...]]) -> Callable[[Env], None]:
    """``run(env)`` for a segment: its units in order, each followed by dropping the values last used there."""
    plan = [(run, dead) for (run, _), dead in zip(units, drops)]

    def run(env):
        for step, dead in plan:
            step(env)
            for name in dead:
                env.pop(name, None)
    return run


def _readers(program: Program) -> dict[int, set[int]]:
    """Per value: the ids of the steps (or fused GEMMs) that read it; -1 marks a program output."""
    readers: dict[int, set[int]] = {}
    for seg in program.segments:
        for s in seg.steps:
            for a in s.op.inputs:
                if isinstance(a, int):
                    readers.setdefault(a, set()).add(id(s))
        if seg.fused is not None:
            for a in (seg.fused.x, seg.fused.weight, seg.fused.bias, seg.fused.residual):
                if a is not None:
                    readers.setdefault(a, set()).add(id(seg.fused))
    for o, _ in program.outputs:
        readers.setdefault(o, set()).add(-1)
    return readers


def _attrs_per_call(attrs: dict) -> Callable[[Env], dict]:
    """``attrs(env)``: a step's attributes on a call, those that scalar inputs give per call
    (``OpDef.value_attrs``) read from the numbers ``run_eager`` put in ``env``."""
    if not symbols_of(tuple(attrs.values())):
        return lambda env: attrs
    return lambda env: {k: resolve_symbols(v, None, env.__getitem__) for k, v in attrs.items()}


def _nothing(x) -> None:
    """A step on a rank that takes no part in it."""
    return None


def _not_in(skipped: set[int]) -> Callable:
    """``regions.fusible``, except for the steps in ``skipped`` (taken into a GEMM's epilogue)."""
    return lambda step: id(step) not in skipped and regions.fusible(step)


def _gemm_gelu(gemm: Compute, act: Compute, in_gemm: bool) -> Callable[[Env], None]:
    """A linear with a bias and the tanh-GELU of its result as one call (``program.gelu_epilogues``): the
    GELU in the GEMM's epilogue, or as an in-place pass after it (``in_gemm`` False)."""
    if not gemm.runs_here:
        return lambda env: None
    x, w, b = gemm.op.inputs
    (out,) = act.op.outputs

    def run(env):
        env[out] = overlap.linear(env[x], env[w], env[b], overlap.gelu_tanh, gelu_in_gemm=in_gemm)
    return run


def _fused(f: FusedGemm, program: Program, gelu_in_gemm: bool | None = None) -> Callable[[Env], None]:
    """``run(env)`` for a fused segment through ``tp_fusion.runtime.overlap``, in ``f.mode``, with a
    tanh-GELU epilogue in the GEMM unless ``program.gelu_apart`` (or ``gelu_in_gemm``) says otherwise."""
    pg = dist.group(f.group)
    mode = f.mode or FUSED
    epilogue = _epilogue(f.epilogue)
    in_gemm = f.out not in program.gelu_apart if gelu_in_gemm is None else gelu_in_gemm
    tuning = dataclasses.replace(f.tuning or overlap.DEFAULT_TUNING, gelu_in_gemm=in_gemm)
    x_name, w_name, b_name, r_name, out, dim = f.x, f.weight, f.bias, f.residual, f.out, f.dim
    transpose = f.transpose_weight

    def operands(env):
        w = env[w_name].t() if transpose else env[w_name]
        return (env[x_name], w, None if b_name is None else env[b_name],
                None if r_name is None else env[r_name])
    inner = _fused_run(f, pg, mode, epilogue, operands, tuning)
    n = dist.group_size(pg)

    def run(env):
        x, w, b, res = operands(env)
        if x.numel() and w.numel():
            return inner(env)
        # An empty operand (zero rows, or an empty contraction): the GEMM contributes nothing, so no
        # collective is needed (every rank holds alike-shaped shards of the same global shapes, so
        # all skip it). The result is the bias (added once) broadcast over the output's shape, plus
        # the residual.
        shape = list(x.shape)
        if f.collective is Collective.ALLGATHER:
            shape[dim] *= n
        elif f.collective is Collective.REDUCE_SCATTER:
            shape[dim] //= n
        y = torch.nn.functional.linear(x.new_zeros(shape), w, b)
        if epilogue is not None and f.collective is Collective.ALLGATHER:
            y = epilogue(y)
        elif res is not None:
            y = y + res
        env[out] = y
    return run


def _fused_run(f: FusedGemm, pg, mode: str, epilogue, operands, tuning) -> Callable[[Env], None]:
    out, dim = f.out, f.dim
    if f.collective is Collective.ALLGATHER:
        def run(env):
            x, w, b, _ = operands(env)
            env[out] = overlap.allgather_linear(x, w, b, gather_dim=dim, pg=pg, epilogue=epilogue, mode=mode,
                                                tuning=tuning)
    elif f.collective is Collective.REDUCE_SCATTER:
        def run(env):
            x, w, b, res = operands(env)
            env[out] = overlap.linear_reduce_scatter(x, w, b, residual=res, scatter_dim=dim, pg=pg, mode=mode,
                                                     tuning=tuning)
    else:
        def run(env):
            x, w, b, res = operands(env)
            env[out] = overlap.linear_allreduce(x, w, b, residual=res, pg=pg, mode=mode, tuning=tuning)
    return run


def _epilogue(chain: tuple) -> Callable | None:
    """The pointwise chain after a fused GEMM as one callable (None if empty). A lone tanh-GELU is
    ``overlap.gelu_tanh``, which the CUDA kernels fuse into the GEMM itself."""
    if not chain:
        return None
    if len(chain) == 1 and is_tanh_gelu(chain[0][0], dict(chain[0][1])):
        return overlap.gelu_tanh
    steps = [(kind, dict(attrs)) for kind, attrs in chain]

    def run(t):
        for kind, attrs in steps:
            t = OPS[kind].impl(t, **attrs)
        return t
    return run
