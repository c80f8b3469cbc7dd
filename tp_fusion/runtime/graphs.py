"""Replaying a plan as a CUDA graph, where that measures faster than launching it from Python.

At small sizes the GPU runs an MLP faster than Python issues its kernels and collectives (2x H200,
tokens 256, hidden 1024: 0.11 ms of GPU work, 0.19 ms of host time per call), so the plan is
captured once (NCCL collectives, aten kernels, and the fused segments' copies and flags on the
symmetric-memory path) and replayed: the host then copies the inputs that changed memory into the
graph's buffers (``GraphedRun``), replays, and clones the outputs.
Whether to replay is measured by ``tp_fusion.runtime.tuning`` on every rank and agreed (max over
ranks), so all ranks choose alike.

A graph that captured NCCL collectives must be released before its communicator is destroyed,
or ``ncclCommDestroy`` waits forever (pytorch/pytorch#115388): ``tp_fusion.runtime.dist.
destroy_process_group`` releases every live graph first (``release_all``); a program that calls
``torch.distributed.destroy_process_group`` itself calls ``tp_fusion.release_cuda_graphs()`` first.
``TP_FUSION_CUDA_GRAPHS=0`` turns graphs off (see ``enabled``).
"""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Callable

import torch

from tp_fusion.runtime import dist, symm

_live: weakref.WeakSet = weakref.WeakSet()


class GraphedRun:
    """A plan run captured as CUDA graphs; ``replay(inputs)`` returns fresh outputs.

    The graph reads an input in place, from the tensor it was captured with (held here, so its memory
    stays put), as long as every call passes that same tensor: weights are then never copied, and an
    in-place update of them (an optimizer step) is seen by the next replay. An input that arrives in
    other memory (activations, new each call) gets a buffer of its own that each call copies into:
    the graphs are captured again with that buffer, on this rank alone (capturing runs no collective).

    A plan with fused segments runs them with mailboxes of its own (``symm.OwnMailboxes``), whose
    state on the GPU repeats every few calls (``symm.Mailbox.PHASES``): one graph is captured per
    call of that cycle, and replays take them in turn, the host's view of the phases kept in step, so
    that an eager run (within ``with graphed.mailboxes:``, once the graphs are released or a
    recapture failed) carries on where the replays left off, paired with the peers' replays.
    """

    def __init__(self, run: Callable[[list], list], inputs: list[torch.Tensor]):
        """Run the plan once eagerly (lazy initializations, such as a first NCCL collective creating its
        communicator or a fused segment its mailboxes, cannot happen inside a capture), then capture it."""
        self._run, self._copied = run, [False] * len(inputs)
        self.mailboxes = symm.OwnMailboxes()
        self._graphs: list[tuple[torch.cuda.CUDAGraph, list[torch.Tensor], tuple[int, ...]]] = []
        self._next = 0
        with self.mailboxes:
            run(inputs)
        torch.cuda.synchronize()
        self._capture(inputs)
        if not _live:
            dist.before_destroy(release_all)
        _live.add(self)

    def _capture(self, inputs: list[torch.Tensor]) -> None:
        """Capture the run on ``inputs`` (copies where ``_copied``), once per call until the mailboxes'
        phases come round to where they started. The graphs share one memory pool: they replay one
        after another on one stream, and each replay's outputs are cloned before the next, so a graph
        may reuse what an earlier one freed, and the plan's intermediates are held once, not once per
        graph. A capture that fails leaves the caching allocator with a capture underway (torch 2.11),
        which aborts the process at exit; it is ended before the error goes on, and the phases are put
        back (nothing captured ran). Python's garbage collector is off meanwhile: it could free another
        plan's graphs mid-capture, and a graph's reset is not permitted while a stream captures (it
        invalidated the capture: 5 of about 850 plans fell back to eager launches on one H100)."""
        self.inputs = [x.clone() if copied else x for x, copied in zip(inputs, self._copied)]
        start = self.mailboxes.phases()
        stream, pool = torch.cuda.current_stream(), torch.cuda.graph_pool_handle()
        collecting = gc.isenabled()
        gc.disable()  # torch.cuda.graph collects once as it starts; nothing is collected until the end
        try:
            for _ in range(symm.Mailbox.PHASES):
                phases, graph = self.mailboxes.phases(), torch.cuda.CUDAGraph()
                try:
                    # thread_local: another thread's CUDA calls (NCCL's watchdog querying the events of work
                    # that DTensor or the user left in flight) must not invalidate this thread's capture
                    with self.mailboxes, torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                        outputs = self._run(self.inputs)
                except BaseException:
                    _end_capture_allocations(pool)
                    torch.cuda.set_stream(stream)  # the capture's stream context is left open when it fails
                    raise
                self._graphs.append((graph, outputs, phases))
                if self.mailboxes.phases() == start:
                    break
        except BaseException:
            self.release()
            self.mailboxes.set_phases(start)
            raise
        finally:
            if collecting:
                gc.enable()
        self._next = 0

    @property
    def alive(self) -> bool:
        return bool(self._graphs)

    def release(self) -> None:
        for graph, _, _ in self._graphs:
            graph.reset()
        self._graphs = []

    def replay(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        moved = [i for i, (held, x) in enumerate(zip(self.inputs, inputs))
                 if not self._copied[i] and x.data_ptr() != held.data_ptr()]
        if moved:
            self.release()
            for i in moved:
                self._copied[i] = True
            try:
                self._capture(inputs)
            except Exception:  # this rank runs eagerly from now on: the same collectives, in the same order
                with self.mailboxes:
                    return self._run(inputs)
        for held, x, copied in zip(self.inputs, inputs, self._copied):
            if copied:
                held.copy_(x)
        graph, outputs, _ = self._graphs[self._next]
        graph.replay()
        self._next = (self._next + 1) % len(self._graphs)
        self.mailboxes.set_phases(self._graphs[self._next][2])
        return [out.clone() for out in outputs]


def _end_capture_allocations(pool) -> None:
    """End allocating into a failed capture's memory pool: torch 2.11's ``capture_end`` raises before
    it does so when the capture was invalidated (a later version that did it makes this raise, which
    is harmless). The pool itself is released with its ``CUDAGraph``: releasing it here too aborted
    the process (a negative use count)."""
    try:
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)
    except RuntimeError:
        pass


def release_all() -> None:
    """Release every captured graph (before destroying the process group); plans run eagerly again."""
    for graphed in list(_live):
        graphed.release()


def enabled() -> bool:
    """On unless ``TP_FUSION_CUDA_GRAPHS=0``. Round 2 turned graphs off after a captured plan gave
    wrong values on one rank of 2x H200: one rank failed its capture, reported a fault and aborted
    its group, while its peer replayed its graph. Tuning now captures without fault reporting and
    the ranks agree that all captured before anything runs again; the whole GPU suite then passed
    with graphs on (docs/performance.md, "Correctness on the GPUs")."""
    return os.environ.get("TP_FUSION_CUDA_GRAPHS", "1") != "0"
