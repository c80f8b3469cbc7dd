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

Building a plan is collective as well (process groups, tuning), so the plan cache is keyed by what
every rank sees alike for valid inputs (``_InputView``): the shapes, dtypes and devices of the
inputs a rank holds, not their strides nor the empty tensors of inputs it holds no part of, plus
the global shapes of symbolic inputs that some rank cannot see, exchanged on every call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import threading
from collections.abc import Sequence

import torch

from tp_fusion import errors
from tp_fusion.compile import (
    as_declared,
    bound_scalar_inputs,
    check_layout,
    check_mesh_sizes,
    check_unheld,
    compile_program,
    declared_layouts,
    global_input_shapes,
    numbers_as_tensors,
    per_call_scalar_inputs,
)
from tp_fusion.errors import DefinitionError, ExecutionError, InputError, TPFusionError
from tp_fusion.ir import Fusion
from tp_fusion.ops import python_scalar
from tp_fusion.program import Program
from tp_fusion.runtime import dist, faults, symm, tuning
from tp_fusion.runtime.runner import Runner

_executing = threading.Lock()  # one execute at a time per process
_lagged = faults.LaggedAgreement()  # per-call agreement under NCCL (nothing waits for it)
_progress = faults.ProgressGuard()  # bounded waits for peers on the GPU


@dataclasses.dataclass(frozen=True)
class _InputView:
    """How one rank's inputs key a cached plan, so that for valid inputs every rank finds a plan or
    builds one at the same call (building is collective: process groups, tuning)."""

    held: tuple[bool, ...]  # which inputs this rank holds a part of
    checked: tuple[int, ...]  # checked on every call, as the key leaves them out: unheld, or with a declared layout
    exchanged: tuple[int, ...]  # symbolic extents some rank cannot know (it holds no part): exchanged every call
    bound: tuple[int, ...]  # scalar inputs whose values the plan is built for (ops take them as attributes)
    per_call: tuple[int, ...]  # scalar inputs that value attributes read (``OpDef.value_attrs``): every call


def _input_view(fusion: Fusion, rank: int, world: int) -> _InputView:
    tensors = [fusion.tensor(name) for name in fusion.inputs]
    held = tuple(t.held_by(rank) for t in tensors)
    layouts = declared_layouts(fusion)
    checked = tuple(i for i, (name, h) in enumerate(zip(fusion.inputs, held))
                    if not h or (name in layouts and layouts[name].constrains))
    exchanged = tuple(i for i, t in enumerate(tensors)
                      if -1 in t.shape and not all(t.held_by(r) for r in range(world)))
    bound, per_call = bound_scalar_inputs(fusion), per_call_scalar_inputs(fusion)
    return _InputView(held, checked, exchanged, tuple(i for i, name in enumerate(fusion.inputs) if name in bound),
                      tuple(i for i, name in enumerate(fusion.inputs) if name in per_call))


def _signature(inputs: Sequence, view: _InputView) -> tuple:
    """What a compiled plan depends on: the shapes, dtypes and devices of the inputs this rank holds, and
    their kinds (a DTensor or a sparse tensor misses the plan of a dense one of its shape, so the checks of
    a compile refuse it). Not their strides (a declared layout is checked on every call), nor the empty
    tensors passed for inputs it holds no part of: a rank whose layouts differ from its peers' still finds
    the plan they find."""
    if len(inputs) != len(view.held):
        return (len(inputs),)
    return tuple(None if not h else (tuple(x.shape), x.dtype, x.device, x.layout, dist.is_dtensor(x))
                 if isinstance(x, torch.Tensor) else type(x) for x, h in zip(inputs, view.held))


def _scalar_values(fusion: Fusion, inputs: list, indices: tuple[int, ...]) -> dict[int, object]:
    """The values of the scalar inputs at ``indices`` (those the plan is built for, or those read per call),
    by name, read off what execute was given (a number is read without touching a device; a 0-d tensor is
    read with ``item``, None if no 0-d tensor: execute refuses it)."""
    if len(inputs) != len(fusion.inputs):
        return {}
    values = {}
    for i in indices:
        x = python_scalar(inputs[i])
        values[fusion.inputs[i]] = x if not isinstance(x, torch.Tensor) else x.item() \
            if x.dim() == 0 and not dist.is_dtensor(x) else None
    return values


class Executor:
    """Runs one fusion definition; keeps a compiled program and its runner per input signature."""

    def __init__(self, fusion: Fusion, serial: int = 0):
        self.fusion = fusion
        self.serial = serial  # which of this rank's fusions it is (creation order, the same on every rank)
        self._sharded = fusion.has_meshes
        self._text = str(fusion)
        self._identity = _fingerprint(serial, self._text)  # which fusion this is, alike on every rank
        self._cache: dict[tuple, tuple[Program, Runner, int, str]] = {}
        self._views: dict[tuple[int, int], _InputView] = {}

    def run(self, inputs: list) -> tuple[list[torch.Tensor], Program]:
        if not _executing.acquire(blocking=False):
            raise ExecutionError("execute: another thread of this process is executing a fusion; a rank runs "
                                 "its fusions one at a time, in the same order as its peers (collectives would "
                                 "interleave otherwise)")
        try:
            with _as_declared():
                outputs, program = self._run(inputs)
            return _write_aliases(self.fusion, program, inputs, outputs), program
        finally:
            _executing.release()

    def _run(self, inputs: list) -> tuple[list[torch.Tensor], Program]:
        """``run``, under ``_as_declared``."""
        world = dist.world_token()
        multi = self._sharded and world is not None and dist.world_size() > 1
        every_call = multi and agrees_every_call(dist.backend())
        rank, size = dist.rank(), dist.world_size() if dist.is_initialized() else 1
        view = self._views.get((rank, size))
        if view is None:
            view = self._views[rank, size] = _input_view(self.fusion, rank, size)
        scalars = _scalar_values(self.fusion, inputs, view.bound)
        read = _scalar_values(self.fusion, inputs, view.per_call)
        inputs = numbers_as_tensors(self.fusion, inputs)
        extents = ()
        if multi and view.exchanged:
            # The exchange is a collective that only such fusions run: first make sure that every rank
            # executes this fusion, so that a peer executing another one is told so instead of waiting.
            _agree(None, self._identity, (self._identity, "before exchanging its symbolic extents"))
            extents = _exchange_extents(self.fusion, inputs, view)
        sig = (_signature(inputs, view), extents, tuple(scalars.values()))
        cached = self._cache.get(sig)
        if cached is not None and cached[1].world != world:
            self._cache.clear()  # the process group these were built under is gone
            cached = None
        error, refused = None, {}
        try:
            if cached is None:
                program, fingerprint, detail = self._compile(inputs, dict(zip(view.exchanged, extents)), scalars)
            else:
                program, runner, fingerprint, detail = cached
                refused = _unkeyed_refusals(self.fusion, inputs, view, rank)
                if refused:
                    raise next(iter(refused.values()))
        except TPFusionError as e:
            error = e
        except Exception as e:  # an internal error: still agree, so no peer is left waiting
            if not multi:
                raise
            error = e
        if multi and (cached is None or every_call):
            rebuild = _agree(error, 0 if error is not None else fingerprint, detail if error is None else None,
                             building=cached is None)
            if rebuild and cached is not None:
                # A peer builds this plan (its definition was changed and changed back, say): building is
                # collective (process groups, tuning), so this rank builds it again alongside.
                program, fingerprint, detail = self._compile(inputs, dict(zip(view.exchanged, extents)), scalars)
                cached = None
        deferred = None
        if error is not None:
            if cached is None or not multi or every_call:
                raise error
            # Under NCCL a cached plan runs without agreement, so the peers are in its collectives by now:
            # this rank runs it too, on stand-ins for the inputs that failed their check, then raises.
            deferred = type(error)(f"{error} (this rank ran the plan on stand-ins for it first, so that its "
                                   "peers, which run the cached plan without checking with it, were not left "
                                   "waiting; their results are right)")
            inputs = _stand_ins(self.fusion, inputs, refused, view, program.device)
        guarded = multi and program.device.type == "cuda"
        if guarded:
            _progress.before_call(world, program.rank, symm.release_waits)
        if multi and not every_call:
            _lagged.check_and_launch(world, fingerprint)
        numbers = program.numbers(read) if program.numbers is not None else None
        if cached is None:
            runner = Runner(program)  # creates process groups: after the agreement
            program, runner = tuning.tune(program, runner, inputs, numbers)
            self._cache[sig] = (program, runner, fingerprint, detail)
        outputs = runner.run(inputs, numbers)
        if guarded:
            _progress.after_call()
        if deferred is not None:
            raise deferred
        return outputs, program

    def _compile(self, inputs: list, known: dict[int, tuple[int, ...]],
                 scalars: dict[int, object]) -> tuple[Program, int, tuple[int, str]]:
        """This rank's program for these inputs, its fingerprint, and (the fusion's fingerprint, a
        description of the shapes and bound scalars): what the agreement reports when the ranks differ.
        ``known``: the exchanged global shapes of inputs this rank may hold no part of; ``scalars``: the
        values of the scalar inputs that the plan is built for."""
        rank = dist.rank()
        if dist.is_initialized():
            check_mesh_sizes(self.fusion, dist.world_size())
        _check_process_group(self.fusion)
        shapes = global_input_shapes(self.fusion, inputs, rank)
        shapes = [known[i] if i in known and -1 in shape else shape for i, shape in enumerate(shapes)]
        device = next((x.device for x in inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))
        _check_backend(self.fusion, inputs)
        program = compile_program(self.fusion, shapes, rank, device, scalars)
        described = ", ".join(f"T{n} {list(s)}" for n, s in zip(self.fusion.inputs, shapes))
        described += "".join(f", T{n} = {v}" for n, v in scalars.items())
        detail = (self._identity, described)  # which fusion, and its input shapes and bound scalars
        return program, _fingerprint(self._identity, tuple(map(tuple, shapes)), scalars), detail


def _write_aliases(fusion: Fusion, program: Program, inputs: list, outputs: list) -> list[torch.Tensor]:
    """What ``execute`` returns: ``outputs`` (one per output of ``fusion``) less the aliased ones, which are
    written into their inputs in place first (``add_output(tv, alias_input=)``; the plan gave them the
    inputs' shardings). As in nvFuser, a plain output of an aliased tensor or of its input is then that
    input itself, where the plan gives it the input's sharding. Runs in the caller's mode (not
    ``_as_declared``'s), so that an inference tensor is written in inference mode."""
    if not fusion.aliases:
        return outputs
    position = {name: k for k, name in enumerate(fusion.inputs)}
    holds = {}  # tensor of the definition -> (the input now holding its value, that input's name)
    with torch.no_grad():
        for p, i in fusion.aliases:
            x = inputs[position[i]]
            x.copy_(outputs[p])
            holds[fusion.outputs[p]] = holds[i] = (x, i)
    lowered, returned = program.fusion, []
    for p in fusion.returned:
        out = outputs[p]
        x, i = holds.get(fusion.outputs[p], (out, None))
        same = i is not None and lowered.tensor(lowered.outputs[p]).sharding == lowered.tensor(i).sharding
        returned.append(x if same else out)
    return returned


def _exchange_extents(fusion: Fusion, inputs: list, view: _InputView) -> tuple[tuple[int, ...], ...]:
    """The global shapes of the inputs whose symbolic extents some rank cannot know (it holds no part
    of them), as their holders see them: one host-side all_reduce(MAX) on every call of such a fusion,
    before anything can raise, so that every rank compiles, keys and builds its plan with the same
    shapes. A holder whose own shape differs from the result is caught by the agreement."""
    dims = []
    for i in view.exchanged:
        t = fusion.tensor(fusion.inputs[i])
        x = inputs[i] if i < len(inputs) else None
        fits = view.held[i] and isinstance(x, torch.Tensor) and x.dim() == t.ndim
        dims.extend(t.sharding.global_shape(tuple(x.shape)) if fits else [-1] * t.ndim)
    v = torch.tensor(dims, dtype=torch.int64)
    try:
        dist.host_all_reduce_max(v)
    except Exception as e:  # a peer left (or failed in an earlier plan): the process group is broken
        raise ExecutionError(faults.report_failure(
            dist.rank(), "the exchange of symbolic extents before running the plan", f"{type(e).__name__}: {e}",
            local=False, exc=e)) from e
    flat, out = v.tolist(), []
    for i in view.exchanged:
        n = fusion.tensor(fusion.inputs[i]).ndim
        out.append(tuple(flat[:n]))
        flat = flat[n:]
    return tuple(out)


def _unkeyed_refusals(fusion: Fusion, inputs: list, view: _InputView, rank: int) -> dict[int, TPFusionError]:
    """On a cached plan, what its key leaves out, checked: the declared layouts of the inputs this rank
    holds, and the empty tensors for those it holds no part of (``global_input_shapes`` checks them on
    a miss). Returns each refused input's error, by position."""
    layouts, refused = declared_layouts(fusion), {}
    for i in view.checked:
        name, x = fusion.inputs[i], inputs[i]
        try:
            if view.held[i]:
                check_layout(f"T{name}", x, layouts[name])
            else:
                check_unheld(name, fusion.tensor(name), x, rank)
        except TPFusionError as e:
            refused[i] = e
    return refused


def agrees_every_call(backend: str) -> bool:
    """Whether the ranks agree on every call of a cached plan too: under gloo (a host exchange is cheap
    beside CPU work). Under NCCL only a compile agrees, as a host round trip per call would bound the
    call rate; ``faults.LaggedAgreement`` checks the calls later instead."""
    return backend == "gloo"


def _stand_ins(fusion: Fusion, inputs: list, refused: dict, view: _InputView, device: torch.device) -> list:
    """``inputs`` with the ``refused`` ones replaced by what the checks accept: the same values laid out
    as declared, or an empty tensor for an input this rank holds no part of (its values are never read)."""
    fixed = list(inputs)
    for i in refused:
        if view.held[i]:  # refused for its layout
            fixed[i] = as_declared(fusion, i, inputs[i])
        else:
            fixed[i] = torch.empty(0, dtype=fusion.tensor(fusion.inputs[i]).dtype.torch, device=device)
    return fixed


def _fingerprint(*parts) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _check_process_group(fusion: Fusion) -> None:
    meshes = {t.sharding.mesh for t in fusion.tensors if t.sharding is not None}
    if meshes and not dist.is_initialized() and any(m.devices != (0,) for m in meshes):
        missing = "execute: the fusion's meshes name ranks other than 0, but no torch.distributed process group is " \
                  "initialized"
        if dist.aborted():
            raise InputError(f"{missing}: a plan that failed on this rank earlier (its ExecutionError) destroyed it, "
                             "so that no peer waited on it; initialize it again (torch.distributed."
                             "init_process_group) before executing")
        raise InputError(f"{missing}; under torchrun call torch.distributed.init_process_group first, or start the "
                         "ranks with tp_fusion.launch.run_on_ranks, which initializes it")


def _check_backend(fusion: Fusion, inputs: list) -> None:
    if not (dist.is_initialized() and fusion.has_meshes):
        return
    backend = dist.backend()
    want = "cuda" if backend == "nccl" else "cpu"
    for name, x in zip(fusion.inputs, inputs):
        if isinstance(x, torch.Tensor) and x.numel() and x.device.type != want:
            raise InputError(f"execute: input T{name} is on {x.device} with a {backend} process group; use "
                             "CUDA tensors with NCCL and CPU tensors with gloo")


def report_of(error: Exception | None) -> tuple[str, str] | None:
    """What a rank tells its peers of its error (None: it has none)."""
    return None if error is None else (type(error).__name__, str(error))


def raise_reported(reports: list, error: Exception | None) -> None:
    """Given every rank's ``report_of`` its error, raise on every rank if any has one: this rank's own
    error, else the first failed peer's, as an error of the same class naming that rank."""
    if error is not None:
        raise error
    bad, report = next(((r, rep) for r, rep in enumerate(reports) if rep is not None), (None, None))
    if report is None:
        return
    name, msg = report
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, TPFusionError)):  # an internal error on that rank
        raise ExecutionError(f"rank {bad} failed while compiling the plan: {name}: {msg}")
    raise cls(f"rank {bad} rejected its inputs: {msg}")


def _agree(error: Exception | None, fingerprint: int, detail: tuple[int, str] | None, building: bool = False) -> bool:
    """Raise on every rank if any rank's inputs were rejected, or if the ranks compiled different
    fusions, global shapes or calls (one host-side all_reduce; a gather only when something is wrong).
    Returns whether some rank is ``building`` its plan."""
    rank = dist.rank()
    try:
        failed, differ, any_building = faults.agree(error is not None, fingerprint, building)
    except Exception as e:  # a peer left (or failed in an earlier plan): the process group is broken
        raise ExecutionError(faults.report_failure(
            rank, "the input agreement before running the plan", f"{type(e).__name__}: {e}",
            local=False, exc=e)) from (error or e)
    if not failed and not differ:
        return any_building
    if failed:
        raise_reported(dist.gather_from_all(report_of(error)), error)
    views = dist.gather_from_all((fingerprint, detail))
    counts: dict[int, int] = {}
    for fp, _ in views:
        counts[fp] = counts.get(fp, 0) + 1
    common = max(counts, key=lambda fp: (counts[fp], -next(r for r, v in enumerate(views) if v[0] == fp)))
    ref = next(r for r, v in enumerate(views) if v[0] == common)
    odd = [r for r, v in enumerate(views) if v[0] != common]
    if any(v[1][0] != views[ref][1][0] for v in views):
        raise DefinitionError(
            f"execute: rank(s) {odd} executed another fusion than rank {ref} did (different ops or shardings, "
            "or another of its fusions: ranks tell fusions apart by the order they created them); every rank "
            "must create the same FusionDefinitions in the same order and execute them in the same order")
    lines = "; ".join(f"rank {r}: {views[r][1][1]}" for r in [ref, *odd])
    raise InputError(
        f"execute: the ranks' inputs imply different global shapes ({lines}); rank(s) {odd} differ from "
        f"rank {ref}. Pass every rank its shard (shard_tensor) of the same global tensors: a split dim's "
        "shards all have one extent (uneven pieces, as torch.tensor_split makes of an extent that does not "
        "divide, are not supported)")


def _as_declared() -> contextlib.ExitStack:
    """What a plan runs under: the dtypes its fusion declares, as nvFuser's kernels do (autocast off: its aten
    calls would otherwise compute in the autocast dtype and meet buffers in the declared one), and outside
    inference mode, so that the buffers a call caches (mailboxes, CUDA-graph pools) serve later calls in either
    mode (made under it, they are inference tensors, which a later call outside it may not write)."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))
    for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
        stack.enter_context(torch.autocast(device, enabled=False))
    return stack
