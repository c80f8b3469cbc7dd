"""The execution plan: a lowered, segmented fusion compiled for one input signature.

``str(plan)`` prints the segments in order (the same text on every rank); ``collectives()``
names the communications they run; ``run`` executes the plan on this rank's local shards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tp_fusion.passes.lower_communications import COLLECTIVES, LOCAL_RESHARDS
from tp_fusion import ops as _ops
from tp_fusion.errors import ExecutionError
from tp_fusion.ir import Const, Fusion, Op, Segment
from tp_fusion.runtime import collectives, dist, graphs, overlap

RESHARDS = COLLECTIVES + LOCAL_RESHARDS


@dataclass
class CompiledOp:
    op: Op
    attrs: dict  # attributes for running on local shards
    runs_here: bool  # whether this rank takes part
    run: Callable[[dict], None] = field(default=None, repr=False)  # env -> None, built at compile time


@dataclass
class CompiledSegment:
    segment: Segment
    ops: list[CompiledOp]
    choice: str | None = None  # for fused segments: "fused" or "sequential", decided on first run
    pg: object = field(default=None, repr=False)
    run_fused: Callable[[dict], None] | None = field(default=None, repr=False)

    @property
    def collectives(self) -> list[str]:
        return [c.op.kind for c in self.ops if c.op.kind in COLLECTIVES]


# Ops whose result may be a view of their input: such a result is never reduced in place.
VIEW_OPS = ("permute", "reshape", "squeeze", "unsqueeze", "broadcast_in_dim", "slice", "to_partial")


class Plan:
    def __init__(self, fusion: Fusion, rank: int, device: torch.device):
        self.fusion, self.rank, self.device = fusion, rank, device
        last_use = {}
        for i, op in enumerate(fusion.ops):
            for a in op.tensor_inputs:
                last_use[a] = i
        keep = set(fusion.inputs) | set(fusion.outputs)
        self.segments: list[CompiledSegment] = []
        for seg in fusion.segments:
            compiled = []
            for i in seg.ops:
                op = fusion.ops[i]
                if op.kind in COLLECTIVES:
                    mesh = fusion.tensor(op.inputs[0]).sharding.mesh
                    for ranks in collectives.groups_of(op, mesh):
                        dist.group(ranks)  # every rank creates every group, in plan order
                donate = bool(op.tensor_inputs) and self._donatable(op.inputs[0], i, keep, last_use)
                c = CompiledOp(op, self._local_attrs(op), self._runs_here(op))
                c.run = self._runner(c, donate)
                compiled.append(c)
            cs = CompiledSegment(seg, compiled)
            if seg.kind == "fused":
                comm = next(c.op for c in compiled if c.op.kind in COLLECTIVES)
                mesh = fusion.tensor(comm.inputs[0]).sharding.mesh
                cs.pg = dist.group(mesh.axis_group(comm.attr("mesh_axis"), rank)) if rank in mesh else None
                cs.run_fused = self._fused_runner(cs)
            self.segments.append(cs)
        self._outputs_here = [(o, self._holds(o)) for o in fusion.outputs]
        self._eager_runs = 0
        self.graph: graphs.GraphedRun | None = None  # set when replaying a CUDA graph measured faster

    # --- compile-time helpers ----------------------------------------------------------------

    def _local_shape(self, name: int) -> tuple[int, ...]:
        t = self.fusion.tensor(name)
        return t.sharding.local_shape(t.shape) if t.sharding else t.shape

    def _local_attrs(self, op: Op) -> dict:
        if op.kind in RESHARDS:
            return dict(op.attrs)
        in_global = [self.fusion.tensor(a).shape for a in op.tensor_inputs]
        out = op.outputs[0]
        return _ops.localize(op.kind, dict(op.attrs), in_global, self.fusion.tensor(out).shape,
                             self._local_shape(out), self.device)

    def _runs_here(self, op: Op) -> bool:
        if op.kind in ("send_recv", "broadcast"):
            src, dst = op.attr("src_mesh"), op.attr("dst_mesh")
            ranks = set(src.devices) | set(dst.devices)
            return self.rank in ranks
        t = self.fusion.tensor(op.inputs[0] if op.kind in RESHARDS else op.outputs[0])
        return t.sharding is None or self.rank in t.sharding.mesh

    # --- inspection --------------------------------------------------------------------------

    def collectives(self) -> list[str]:
        """The collectives the plan runs, in order (fused segments name theirs)."""
        return [name for seg in self.segments for name in seg.collectives]

    def output_shardings(self) -> list:
        return [self.fusion.tensor(o).sharding for o in self.fusion.outputs]

    def summary(self):
        """Per segment: bytes sent/received per rank, FLOPs, fused or not (see ``tp_fusion.summary``)."""
        from tp_fusion.summary import summarize

        return summarize(self)

    def __str__(self) -> str:
        f = self.fusion
        lines = [f"Plan: {len(self.segments)} segment(s); inputs [{', '.join(f'T{i}' for i in f.inputs)}], "
                 f"outputs [{', '.join(f'T{o}' for o in f.outputs)}]"]
        for i, seg in enumerate(self.segments):
            head = f"  segment {i}: {seg.segment.kind}"
            if seg.segment.kind == "fused":
                head += f" {seg.segment.note} ({seg.choice or 'undecided'})"
            lines.append(head)
            for c in seg.ops:
                outs = " ".join(f"{f.tensor(o).type_str()}{f.tensor(o).sharding_str()}" for o in c.op.outputs)
                lines.append(f"    {c.op} : {outs}")
        if self.graph is not None and self.graph.alive:
            lines.append("  replayed as a CUDA graph (measured faster than launching it eagerly)")
        return "\n".join(lines)

    # --- execution ---------------------------------------------------------------------------

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's outputs. The first run decides each fused segment; the second, where the
        plan can be captured, whether to replay it as a CUDA graph from then on."""
        if self.graph is not None and self.graph.alive:
            return self.graph.replay(inputs)
        outs = self._run_eager(inputs)
        self._eager_runs += 1
        if self._eager_runs == 2 and self._graphable():
            self.graph = graphs.capture_if_faster(self._run_eager, inputs)
        return outs

    def _graphable(self) -> bool:
        """The same answer on every rank: CUDA with NCCL (or one process), no segment on the
        symmetric-memory path, every mesh spanning the whole world."""
        world = set(range(dist.world_size()))
        return (self.device.type == "cuda" and graphs.enabled()
                and (not dist.is_initialized() or dist.backend() == "nccl")
                and all(seg.choice != "fused" for seg in self.segments)
                and all(t.sharding is None or set(t.sharding.mesh.devices) == world for t in self.fusion.tensors))

    def _run_eager(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        env: dict[int, torch.Tensor] = dict(zip(self.fusion.inputs, inputs))
        for i, seg in enumerate(self.segments):
            try:
                if seg.run_fused is not None and self._decide(seg) == "fused":
                    seg.run_fused(env)
                else:
                    for c in seg.ops:
                        c.run(env)
            except Exception as e:
                if isinstance(e, ExecutionError):
                    raise
                raise ExecutionError(self._failure(i, seg, e)) from e
        input_storages = {x.untyped_storage().data_ptr() for x in inputs if isinstance(x, torch.Tensor)}
        outs = []
        for o, held in self._outputs_here:
            if not held:  # this rank holds no part of this output
                outs.append(torch.empty((0,), dtype=self.fusion.tensor(o).dtype.torch, device=self.device))
                continue
            x = env[o]
            if not x.is_contiguous():
                x = x.contiguous()
            elif x.untyped_storage().data_ptr() in input_storages:
                x = x.clone()
            outs.append(x)
        return outs

    def _failure(self, i: int, seg: CompiledSegment, e: Exception) -> str:
        """The message for a failure in segment ``i``. Under a process group the failure is published
        and the groups aborted so that every rank fails promptly, naming the rank that failed first."""
        where = f"segment {i} ({seg.segment.kind}{' ' + seg.segment.note if seg.segment.note else ''})"
        error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:400] if str(e).strip() else ''}"
        if not (self.fusion.has_meshes and dist.is_initialized() and dist.world_size() > 1):
            return f"rank {self.rank} failed in {where}: {error}"
        # A RuntimeError out of a segment that communicates is most likely a peer that left: the
        # store says whether another rank failed first.
        primary = seg.segment.kind == "compute" or not isinstance(e, RuntimeError)
        return dist.report_failure(self.rank, where, error, primary, exc=e)

    def _donatable(self, name: int, i: int, keep: set, last_use: dict) -> bool:
        """Whether op ``i`` may overwrite tensor ``name``: its last use, no fusion input or output,
        and no view of or into another tensor (those may still be read)."""
        producer = self.fusion.producer(name)
        return (name not in keep and last_use.get(name) == i
                and (producer is None or producer.kind not in VIEW_OPS)
                and all(c.kind not in VIEW_OPS for c in self.fusion.consumers(name)))

    def _holds(self, name: int) -> bool:
        t = self.fusion.tensor(name)
        return t.sharding is None or self.rank in t.sharding.mesh

    def _runner(self, c: CompiledOp, donate: bool) -> Callable[[dict], None]:
        """``run(env)`` for one op on this rank, with everything but the tensors looked up now."""
        op = c.op
        if not c.runs_here:
            return lambda env: None
        if op.kind in RESHARDS:
            src, out_t = self.fusion.tensor(op.inputs[0]), self.fusion.tensor(op.outputs[0])
            fn = collectives.reshard_fn(op, self.rank, src.sharding.mesh, self._local_shape(out_t.name),
                                        out_t.dtype.torch, self.device, donate)
            name, out = op.inputs[0], op.outputs[0]

            def run_reshard(env):
                result = fn(env.get(name))
                if result is not None:
                    env[out] = result
            return run_reshard
        kind, attrs, outs = op.kind, c.attrs, op.outputs
        ops = _ops.OPS  # looked up per call, so an op's implementation can be swapped (fault tests)
        consts = {i: a.value for i, a in enumerate(op.inputs) if isinstance(a, Const)}
        names = list(enumerate(op.inputs))
        if len(outs) == 1:
            (out,) = outs

            def run_one(env):
                env[out] = ops[kind].impl(*[consts[i] if i in consts else env[a] for i, a in names], **attrs)
            return run_one

        def run_many(env):
            for o, r in zip(outs, ops[kind].impl(*[consts[i] if i in consts else env[a] for i, a in names], **attrs)):
                env[o] = r
        return run_many

    def _gemm_operands(self, gemm: Op) -> Callable[[dict], tuple]:
        """``env -> (x, weight [out, in], bias or None)`` of a linear or matmul."""
        x, w = gemm.inputs[0], gemm.inputs[1]
        if gemm.kind == "matmul":
            return lambda env: (env.get(x), env[w].t(), None)
        b = gemm.inputs[2]
        if isinstance(b, Const):
            return lambda env: (env.get(x), env[w], None)
        return lambda env: (env.get(x), env[w], env[b])

    def _decide(self, seg: CompiledSegment) -> str:
        if seg.choice is None:
            if not all(c.runs_here for c in seg.ops):
                seg.choice = "sequential"
            else:
                comm = next(c.op for c in seg.ops if c.op.kind in COLLECTIVES)
                gemm = next(c.op for c in seg.ops if c.op.kind in ("linear", "matmul"))
                x_shape = self._local_shape(comm.inputs[0] if comm.kind == "allgather" else gemm.inputs[0])
                w_shape = self._local_shape(gemm.inputs[1])
                if gemm.kind == "matmul":
                    w_shape = w_shape[::-1]
                kind = {"allgather": "allgather_linear", "reduce_scatter": "linear_reduce_scatter",
                        "allreduce": "linear_allreduce"}[comm.kind]
                dtype = self.fusion.tensor(gemm.outputs[0]).dtype.torch
                seg.choice = overlap.decide(kind, x_shape, w_shape, dtype, seg.pg)
        return seg.choice

    def _fused_runner(self, seg: CompiledSegment) -> Callable[[dict], None]:
        """``run(env)`` for a fused segment through ``tp_fusion.runtime.overlap``."""
        comm = next(c.op for c in seg.ops if c.op.kind in COLLECTIVES)
        pg = seg.pg
        if comm.kind == "allgather":
            gemm, epilogue = seg.ops[1].op, _epilogue(seg.ops[2:])
            x_name, out, dim = comm.inputs[0], seg.ops[-1].op.outputs[0], comm.attr("dim")
            operands = self._gemm_operands(gemm)

            def run_allgather_linear(env):
                _, w, b = operands(env)
                env[out] = overlap.allgather_linear(env[x_name], w, b, gather_dim=dim, pg=pg, epilogue=epilogue)
            return run_allgather_linear
        operands, out = self._gemm_operands(seg.ops[0].op), comm.outputs[0]
        if comm.kind == "reduce_scatter":
            dim = comm.attr("dim")

            def run_linear_reduce_scatter(env):
                x, w, _ = operands(env)
                env[out] = overlap.linear_reduce_scatter(x, w, scatter_dim=dim, pg=pg)
            return run_linear_reduce_scatter

        def run_linear_allreduce(env):
            x, w, _ = operands(env)
            env[out] = overlap.linear_allreduce(x, w, pg=pg)
        return run_linear_allreduce


def _epilogue(ops: list[CompiledOp]):
    """The pointwise chain after a fused GEMM as one callable (None if empty). A lone tanh-GELU is
    ``overlap.gelu_tanh``, which the CUDA kernels fuse into the GEMM itself."""
    if not ops:
        return None
    if len(ops) == 1 and ops[0].op.kind == "gelu" and ops[0].attrs.get("approximate") == "tanh":
        return overlap.gelu_tanh

    def chain(t):
        for c in ops:
            t = _ops.run(c.op.kind, [t], c.attrs)
        return t
    return chain
