"""The CUDA transport of the fused kernels (``overlap.py``): symmetric memory, stream-ordered flags,
the streams that issue copy-engine pushes, and mailboxes of receive slots.

Symmetric memory (``torch.distributed._symmetric_memory``): every rank of a group allocates a
same-shaped buffer, a rendezvous maps the peers' buffers into this process, and a copy into a peer's
buffer runs on the copy engines over NVLink, taking no SMs from the GEMMs. Flags are 32-bit words in
symmetric memory that stream memory operations (``cuStreamWriteValue32``/``cuStreamWaitValue32``)
write and wait on: the GPU's front end handles them, so no spinning kernel competes with the GEMMs
and the host never synchronizes. The module is imported lazily; nothing here runs on the CPU.
"""

from __future__ import annotations

import functools

import torch

from tp_fusion.runtime import dist


def _symm_mem():
    import torch.distributed._symmetric_memory as symm_mem

    return symm_mem


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized tensor in symmetric memory; ``rendezvous`` must follow on every rank."""
    return _symm_mem().empty(tuple(shape), dtype=dtype, device=device)


def rendezvous(t: torch.Tensor, pg):
    """Collective: map every group rank's ``t`` (from ``empty``) into this process; returns the handle."""
    return _symm_mem().rendezvous(t, dist.group_name(pg))


def peer_tensor(handle, peer: int, t: torch.Tensor) -> torch.Tensor:
    """Group rank ``peer``'s copy of the symmetric tensor ``t`` (same shape and dtype), addressable here."""
    return handle.get_buffer(peer, tuple(t.shape), t.dtype, t.storage_offset())


class StreamFlags:
    """Waits and writes of 32-bit flags enqueued on a stream (``cuStream{Wait,Write}Value32``). A write
    is preceded by a memory fence, so whatever the stream wrote before it (a GEMM's output, a copy) is
    visible to whoever sees the flag."""

    def __init__(self):
        try:
            from cuda.bindings import driver
        except ImportError:  # cuda-python < 12.6 names the module cuda.cuda
            from cuda import cuda as driver
        self._driver = driver
        self._geq = int(driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)

    @staticmethod
    def _check(result, what):
        err = result[0]
        if int(err) != 0:
            raise RuntimeError(f"{what} failed: {err}")

    def wait(self, stream: torch.cuda.Stream, addr: int, value: int) -> None:
        """Work enqueued after this on ``stream`` waits until the int32 at ``addr`` >= ``value``."""
        self._check(self._driver.cuStreamWaitValue32(stream.cuda_stream, addr, value & 0xFFFFFFFF, self._geq),
                    "cuStreamWaitValue32")

    def write(self, stream: torch.cuda.Stream, addr: int, value: int) -> None:
        """Once the work before it on ``stream`` is done, set the int32 at ``addr`` (maybe a peer's)."""
        self._check(self._driver.cuStreamWriteValue32(stream.cuda_stream, addr, value & 0xFFFFFFFF, 0),
                    "cuStreamWriteValue32")


@functools.cache
def stream_flags() -> StreamFlags | None:
    """The flag operations, or None where cuda-python is missing (the fused CUDA path is then unavailable)."""
    try:
        return StreamFlags()
    except ImportError:
        return None


@functools.cache
def comm_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream that issues the copy-engine pushes (high priority: they are tiny to launch)."""
    return torch.cuda.Stream(device, priority=-1)


@functools.cache
def side_stream(device: torch.device) -> torch.cuda.Stream:
    """A second compute stream, for compute/compute overlap (the tail wave of one GEMM with the next)."""
    return torch.cuda.Stream(device)


READY, FREE = 0, 1


class Mailbox:
    """Receive slots in symmetric memory for one (kind, slot shape, dtype, group).

    ``slots[src, part]`` holds what group rank ``src`` pushed here (a slot may be pushed in
    ``parts`` pieces). ``flags[READY, src, part]`` is the epoch of src's last push into it;
    ``flags[FREE, dst, part]`` is the epoch up to which rank ``dst`` is done with the piece that this
    rank pushes into there. Peers write both through their mappings. Every call of a kernel bumps
    ``epoch`` alike on every rank (they make the same calls in the same order), so flags only grow
    and never need resetting.
    """

    def __init__(self, parts: int, part_shape, dtype, pg, device):
        n = dist.group_size(pg)
        self.rank, self.n, self.epoch = dist.group_rank(pg), n, 0
        self.slots = empty((n, parts, *part_shape), dtype, device)
        self.parts = parts
        flags = empty((2, n, parts), torch.int32, device)
        flags.zero_()
        slots_handle = rendezvous(self.slots, pg)
        flags_handle = rendezvous(flags, pg)
        # What this rank pushes to peer p lands in p's slots[rank]; what it flags, in p's flags.
        self.peer_slots = [peer_tensor(slots_handle, p, self.slots)[self.rank] for p in range(n)]
        self._flags = flags  # kept alive: the addresses below point into it and into its peers' copies
        self._flag_base = flags.data_ptr()
        self._peer_flag_base = [peer_tensor(flags_handle, p, flags).data_ptr() for p in range(n)]
        torch.cuda.synchronize(device)
        dist.barrier(pg)  # every rank's flags are zero before anyone writes them

    def _offset(self, which: int, rank: int, part: int) -> int:
        return 4 * ((which * self.n + rank) * self.parts + part)

    def start_call(self) -> int:
        self.epoch += 1
        return self.epoch

    def wait_free(self, stream: torch.cuda.Stream, dst: int, part: int, epoch: int) -> None:
        """Work enqueued after this on ``stream`` waits until ``dst`` is done with the piece ``part``
        that this rank pushed there in the previous call."""
        stream_flags().wait(stream, self._flag_base + self._offset(FREE, dst, part), epoch - 1)

    def mark_ready(self, stream: torch.cuda.Stream, dst: int, part: int, epoch: int) -> None:
        """Once the work before it on ``stream`` is done, raise ``dst``'s ready flag for our piece."""
        stream_flags().write(stream, self._peer_flag_base[dst] + self._offset(READY, self.rank, part), epoch)

    def push(self, stream: torch.cuda.Stream, dst: int, part: int, src: torch.Tensor, epoch: int) -> None:
        """On ``stream``: once ``dst`` is done with the piece, copy ``src`` into it (a copy-engine
        write into the peer's memory) and raise dst's ready flag for it."""
        self.wait_free(stream, dst, part, epoch)
        with torch.cuda.stream(stream):
            self.peer_slots[dst][part].copy_(src)
        self.mark_ready(stream, dst, part, epoch)

    def wait_ready(self, stream: torch.cuda.Stream, src: int, part: int, epoch: int) -> None:
        """Work enqueued after this on ``stream`` waits until ``src`` has pushed ``slots[src, part]``."""
        stream_flags().wait(stream, self._flag_base + self._offset(READY, src, part), epoch)

    def release(self, stream: torch.cuda.Stream, src: int, part: int, epoch: int) -> None:
        """Once the work before it on ``stream`` is done, tell ``src`` that ``slots[src, part]`` may be
        refilled."""
        stream_flags().write(stream, self._peer_flag_base[src] + self._offset(FREE, self.rank, part), epoch)


_mailboxes: dict[tuple, Mailbox] = {}


def mailbox(kind: str, parts: int, part_shape, dtype: torch.dtype, pg, device: torch.device) -> Mailbox:
    """The mailbox for ``kind`` with ``parts`` pieces of ``part_shape`` per peer (created on first use,
    which is collective over ``pg``)."""
    key = (kind, parts, tuple(part_shape), dtype, dist.group_name(pg), device)
    if key not in _mailboxes:
        _mailboxes[key] = Mailbox(parts, part_shape, dtype, pg, device)
    return _mailboxes[key]
