"""The execution plan: a lowered, segmented fusion compiled for one input signature.

``str(plan)`` prints the segments in order (the same text on every rank); ``collectives()``
names the communications they run; ``run`` executes the plan on this rank's local shards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from passes.lower_communications import COLLECTIVES, LOCAL_RESHARDS
from tp_fusion import ops as _ops
from tp_fusion.errors import ExecutionError
from tp_fusion.ir import Const, Fusion, Op, Segment
from tp_fusion.runtime import collectives, dist, overlap

RESHARDS = COLLECTIVES + LOCAL_RESHARDS


@dataclass
class CompiledOp:
    op: Op
    attrs: dict  # attributes for running on local shards
    runs_here: bool  # whether this rank takes part
    donate_input: bool = False  # the input dies here and is no fusion input: may be reused


@dataclass
class CompiledSegment:
    segment: Segment
    ops: list[CompiledOp]
    choice: str | None = None  # for fused segments: "fused" or "sequential", decided on first run
    pg: object = field(default=None, repr=False)

    @property
    def collectives(self) -> list[str]:
        return [c.op.kind for c in self.ops if c.op.kind in COLLECTIVES]


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
                donate = op.inputs[0] not in keep and last_use.get(op.inputs[0]) == i if op.inputs else False
                compiled.append(CompiledOp(op, self._local_attrs(op), self._runs_here(op), donate))
            cs = CompiledSegment(seg, compiled)
            if seg.kind == "fused":
                comm = next(c.op for c in compiled if c.op.kind in COLLECTIVES)
                mesh = fusion.tensor(comm.inputs[0]).sharding.mesh
                cs.pg = dist.group(mesh.axis_group(comm.attr("mesh_axis"), rank)) if rank in mesh else None
            self.segments.append(cs)

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
        return "\n".join(lines)

    # --- execution ---------------------------------------------------------------------------

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        env: dict[int, torch.Tensor] = dict(zip(self.fusion.inputs, inputs))
        for i, seg in enumerate(self.segments):
            try:
                if seg.segment.kind == "fused" and self._decide(seg, env) == "fused":
                    self._run_fused(seg, env)
                else:
                    for c in seg.ops:
                        self._run_op(c, env)
            except Exception as e:
                if isinstance(e, ExecutionError):
                    raise
                raise ExecutionError(self._failure(i, seg, e)) from e
        input_storages = {x.untyped_storage().data_ptr() for x in inputs if isinstance(x, torch.Tensor)}
        outs = []
        for o in self.fusion.outputs:
            x = env.get(o)
            if x is None:  # this rank holds no part of this output
                t = self.fusion.tensor(o)
                x = torch.empty((0,), dtype=t.dtype.torch, device=self.device)
            elif x.untyped_storage().data_ptr() in input_storages or not x.is_contiguous():
                x = x.contiguous().clone() if x.is_contiguous() else x.contiguous()
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

    def _args(self, op: Op, env) -> list:
        return [env[a] if isinstance(a, int) else a.value for a in op.inputs]

    def _run_op(self, c: CompiledOp, env) -> None:
        if not c.runs_here:
            return
        op = c.op
        if op.kind in RESHARDS:
            src = self.fusion.tensor(op.inputs[0])
            out_t = self.fusion.tensor(op.outputs[0])
            x = env.get(op.inputs[0])
            result = collectives.run_reshard(op, x, self.rank, src.sharding.mesh,
                                             self._local_shape(out_t.name), out_t.dtype.torch, self.device,
                                             c.donate_input and not _aliased(x, op.inputs[0], env))
            if result is not None:
                env[op.outputs[0]] = result
            return
        result = _ops.run(op.kind, self._args(op, env), c.attrs)
        for o, r in zip(op.outputs, result if isinstance(result, tuple) else (result,)):
            env[o] = r

    def _gemm_operands(self, gemm: Op, env):
        """(x, weight [out, in], bias) of a linear or matmul."""
        if gemm.kind == "linear":
            bias = gemm.inputs[2]
            return env[gemm.inputs[0]], env[gemm.inputs[1]], None if isinstance(bias, Const) else env[bias]
        return env[gemm.inputs[0]], env[gemm.inputs[1]].t(), None

    def _decide(self, seg: CompiledSegment, env) -> str:
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

    def _run_fused(self, seg: CompiledSegment, env) -> None:
        comm_i = next(i for i, c in enumerate(seg.ops) if c.op.kind in COLLECTIVES)
        comm = seg.ops[comm_i].op
        if comm.kind == "allgather":
            gemm = seg.ops[1].op
            epilogue_ops = seg.ops[2:]

            _, w, b = self._gemm_operands(gemm, {**env, comm.outputs[0]: None})
            result = overlap.allgather_linear(env[comm.inputs[0]], w, b, gather_dim=comm.attr("dim"),
                                              pg=seg.pg, epilogue=_epilogue(epilogue_ops))
            env[seg.ops[-1].op.outputs[0]] = result
            return
        gemm = seg.ops[0].op
        x, w, _ = self._gemm_operands(gemm, env)
        if comm.kind == "reduce_scatter":
            result = overlap.linear_reduce_scatter(x, w, scatter_dim=comm.attr("dim"), pg=seg.pg)
        else:
            result = overlap.linear_allreduce(x, w, pg=seg.pg)
        env[comm.outputs[0]] = result


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


def _aliased(x, name: int, env) -> bool:
    """Whether ``x`` shares storage with another tensor in ``env`` (a view, e.g. a permute, of a
    tensor that is still used): then it must not be reduced in place."""
    if not isinstance(x, torch.Tensor):
        return False
    ptr = x.untyped_storage().data_ptr()
    return any(k != name and isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() == ptr
               for k, v in env.items())
