"""``fd.execute``: compile (cached per input signature), agree across ranks, tune, run.

Every check of the inputs happens before any communication, and under a process group the ranks
agree on the outcome first, so a bad input on one rank raises the same error on all. The agreement
also compares a fingerprint of which fusion this is (its creation order on the rank), its text and
the inputs' GLOBAL shapes, so ranks that pass inconsistent shards, define different fusions or
execute them in different orders raise instead of running mismatched collectives. Process groups
are created (a collective step) only after the ranks agree. Under gloo the ranks agree on every
call. Under NCCL they agree when a plan is compiled (a host round trip per call would stall the GPU
at small sizes: 2x H200, 107 us per agreement), and every call is checked by
``faults.LaggedAgreement``: a digest of every 32 calls goes out in an asynchronous host-side
all_reduce that the end of the next 32 reads.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence

import torch

from tp_fusion.compile import check_mesh_sizes, compile_program, global_input_shapes
from tp_fusion.errors import (
    DefinitionError,
    ExecutionError,
    InputError,
    LoweringError,
    ShardingError,
    TPFusionError,
)
from tp_fusion.ir import Fusion
from tp_fusion.program import Program
from tp_fusion.runtime import dist, faults, symm, tuning
from tp_fusion.runtime.runner import Runner

_ERRORS = {c.__name__: c for c in (InputError, ShardingError, DefinitionError, LoweringError, ExecutionError)}
_executing = threading.Lock()  # one execute at a time per process
_lagged = faults.LaggedAgreement()  # per-call agreement under NCCL (nothing waits for it)
_progress = faults.ProgressGuard()  # bounded waits for peers on the GPU


def _signature(inputs: Sequence) -> tuple:
    """What a compiled plan depends on: shapes, dtypes, devices, and strides (an input whose layout
    changes is checked again against its declared contiguity and stride order)."""
    return tuple((tuple(t.shape), t.stride(), t.dtype, t.device) if isinstance(t, torch.Tensor) else type(t)
                 for t in inputs)


class Executor:
    """Runs one fusion definition; keeps a compiled program and its runner per input signature."""

    def __init__(self, fusion: Fusion, serial: int = 0):
        self.fusion = fusion
        self.serial = serial  # which of this rank's fusions it is (creation order, the same on every rank)
        self._sharded = fusion.has_meshes
        self._text = str(fusion)
        self._cache: dict[tuple, tuple[Program, Runner, int, str]] = {}

    def run(self, inputs: list) -> tuple[list[torch.Tensor], Program]:
        if not _executing.acquire(blocking=False):
            raise ExecutionError("execute: another thread of this process is executing a fusion; a rank runs "
                                 "its fusions one at a time, in the same order as its peers (collectives would "
                                 "interleave otherwise)")
        try:
            return self._run(inputs)
        finally:
            _executing.release()

    def _run(self, inputs: list) -> tuple[list[torch.Tensor], Program]:
        sig = _signature(inputs)
        world = dist.world_token()
        multi = self._sharded and world is not None and dist.world_size() > 1
        backend = dist.backend() if multi else None
        cached = self._cache.get(sig)
        if cached is not None and cached[1].world != world:
            self._cache.clear()  # the process group these were built under is gone
            cached = None
        error = None
        if cached is None:
            try:
                program, fingerprint, detail = self._compile(inputs)
            except TPFusionError as e:
                error = e
            except Exception as e:  # an internal error: still agree, so no peer is left waiting
                if not multi:
                    raise
                error = e
        else:
            program, runner, fingerprint, detail = cached
        if multi and (cached is None or backend == "gloo"):
            _agree(error, 0 if error is not None else fingerprint, detail if error is None else "")
        if error is not None:
            raise error
        guarded = multi and program.device.type == "cuda"
        if guarded:
            _progress.before_call(world, program.rank, symm.release_waits)
        if multi and backend != "gloo":
            _lagged.check_and_launch(world, fingerprint)
        if cached is None:
            runner = Runner(program)  # creates process groups: after the agreement
            program, runner = tuning.tune(program, runner, inputs)
            self._cache[sig] = (program, runner, fingerprint, detail)
        outputs = runner.run(inputs)
        if guarded:
            _progress.after_call()
        return outputs, program

    def _compile(self, inputs: list) -> tuple[Program, int, str]:
        """This rank's program for these inputs, its fingerprint and a description of the shapes."""
        rank = dist.rank()
        if dist.is_initialized():
            check_mesh_sizes(self.fusion, dist.world_size())
        _check_process_group(self.fusion)
        shapes = global_input_shapes(self.fusion, inputs, rank)
        device = next((x.device for x in inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))
        _check_backend(self.fusion, inputs)
        program = compile_program(self.fusion, shapes, rank, device)
        detail = ", ".join(f"T{n} {list(s)}" for n, s in zip(self.fusion.inputs, shapes))
        agreed = _agreed_shapes(self.fusion, shapes)
        return program, _fingerprint(self.serial, self._text, agreed), detail


def _fingerprint(*parts) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _agreed_shapes(fusion: Fusion, shapes: list[tuple[int, ...]]) -> tuple:
    """The global input shapes every rank must agree on: those of inputs every rank holds (a rank
    outside a tensor's mesh cannot know its symbolic extents)."""
    world = set(range(dist.world_size()))
    out = []
    for name, shape in zip(fusion.inputs, shapes):
        t = fusion.tensor(name)
        held_by_all = t.sharding is None or world <= set(t.sharding.mesh.devices)
        out.append(tuple(shape) if held_by_all else t.shape)
    return tuple(out)


def _check_process_group(fusion: Fusion) -> None:
    meshes = {t.sharding.mesh for t in fusion.tensors if t.sharding is not None}
    if meshes and not dist.is_initialized() and any(m.devices != (0,) for m in meshes):
        raise InputError("execute: the fusion is sharded across devices, but no torch.distributed process "
                         "group is initialized; start it under torchrun (or tp_fusion.launch.run_on_ranks) "
                         "and call init_process_group first")


def _check_backend(fusion: Fusion, inputs: list) -> None:
    if not (dist.is_initialized() and fusion.has_meshes):
        return
    backend = dist.backend()
    want = "cuda" if backend == "nccl" else "cpu"
    for name, x in zip(fusion.inputs, inputs):
        if isinstance(x, torch.Tensor) and x.numel() and x.device.type != want:
            raise InputError(f"execute: input T{name} is on {x.device} with a {backend} process group; use "
                             "CUDA tensors with NCCL and CPU tensors with gloo")


def _agree(error: Exception | None, fingerprint: int, detail: str) -> None:
    """Raise on every rank if any rank's inputs were rejected, or if the ranks compiled different
    fusions, global shapes or calls (one host-side all_reduce; a gather only when something is wrong)."""
    rank = dist.rank()
    try:
        failed, differ = faults.agree(error is not None, fingerprint)
    except Exception as e:  # a peer left (or failed in an earlier plan): the process group is broken
        raise ExecutionError(faults.report_failure(
            rank, "the input agreement before running the plan", f"{type(e).__name__}: {e}",
            local=False, exc=e)) from (error or e)
    if not failed and not differ:
        return
    if failed:
        report = None if error is None else (type(error).__name__, str(error))
        reports = dist.gather_from_all(report)
        if error is not None:
            raise error
        bad, (name, msg) = next((r, rep) for r, rep in enumerate(reports) if rep is not None)
        if name not in _ERRORS:  # an internal error while compiling on that rank
            raise ExecutionError(f"rank {bad} failed while compiling the plan: {name}: {msg}")
        raise _ERRORS[name](f"rank {bad} rejected its inputs: {msg}")
    views = dist.gather_from_all((fingerprint, detail))
    counts: dict[int, int] = {}
    for fp, _ in views:
        counts[fp] = counts.get(fp, 0) + 1
    common = max(counts, key=lambda fp: (counts[fp], -next(r for r, v in enumerate(views) if v[0] == fp)))
    ref = next(r for r, v in enumerate(views) if v[0] == common)
    odd = [r for r, v in enumerate(views) if v[0] != common]
    if all(v[1] == views[ref][1] for v in views):
        raise DefinitionError(
            f"execute: rank(s) {odd} executed another fusion than rank {ref} did (different ops or shardings, "
            "or another of its fusions: ranks tell fusions apart by the order they created them); every rank "
            "must create the same FusionDefinitions in the same order and execute them in the same order")
    lines = "; ".join(f"rank {r}: {views[r][1]}" for r in [ref, *odd])
    raise InputError(
        f"execute: the ranks' inputs imply different global shapes ({lines}); rank(s) {odd} differ from "
        f"rank {ref}. Pass every rank its shard (shard_tensor) of the same global tensors")
