"""Host time per call of the operations a fused segment enqueues (flags, pushes, stream waits).

    torchrun --nproc_per_node=2 benchmarks/flag_overhead.py

The fused kernels are host-bound on small shapes, so each enqueued operation's host cost matters.
Prints, max over ranks, microseconds per call over ``--calls`` calls, with the GPU idle and with it busy
(a long GEMM queued first): the ctypes driver calls tp_fusion uses (flag wait and write on a peer's
symmetric memory, a copy-engine push), the same through cuda-python and torch's stream_write_value32_
where present, a stream wait through a reused event, and ``Stream.wait_stream``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from examples.cli import parser  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--calls", type=int, default=2000, help="calls per operation timed")
    return p.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help answers at once

import time  # noqa: E402

import torch  # noqa: E402

from tp_fusion.launch import init_from_env  # noqa: E402
from tp_fusion.runtime import dist, symm  # noqa: E402


def per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        print("benchmarks/flag_overhead.py: this machine has no CUDA GPU; nothing to measure.")
        return
    device = init_from_env()
    box = symm.mailbox("flag_overhead", 1, (1024,), torch.bfloat16, None, device)
    box.start_call()
    peer = (box.rank + 1) % box.n
    main_stream, comm = torch.cuda.current_stream(device), symm.comm_stream(device)
    driver, src = symm.driver(), torch.zeros(1024, dtype=torch.bfloat16, device=device)
    local_flag = torch.ones(1, dtype=torch.int32, device=device)  # bit 0 set: the waits pass at once
    probes = {
        "ctypes cuStreamWaitValue32 (own flag)": lambda: driver.wait(comm, local_flag.data_ptr(), 1),
        "ctypes cuStreamWriteValue32 (peer flag)": lambda: box.mark_ready(comm, peer, 0),
        "ctypes cuMemcpyDtoDAsync (2 KB push)": lambda: driver.copy(comm, box.peer_slot(peer, 0), src),
        "stream_wait (reused event)": lambda: symm.stream_wait(comm, main_stream),
        "Stream.wait_stream": lambda: comm.wait_stream(main_stream),
    }
    try:
        from cuda.bindings import driver as cu

        wait_and = int(cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_AND)
        probes["cuda-python cuStreamWaitValue32"] = lambda: cu.cuStreamWaitValue32(
            comm.cuda_stream, local_flag.data_ptr(), 1, wait_and)
        probes["cuda-python cuStreamWriteValue32"] = lambda: cu.cuStreamWriteValue32(
            comm.cuda_stream, local_flag.data_ptr(), 1, 0)
    except ImportError:
        pass
    symm._symm_mem()
    if hasattr(torch.ops.symm_mem, "stream_write_value32_"):
        flag32 = torch.zeros(1, dtype=torch.uint32, device=device)

        def torch_write():
            with torch.cuda.stream(comm):
                torch.ops.symm_mem.stream_write_value32_(flag32, 0, 0)
        probes["torch stream_write_value32_ (+stream context)"] = torch_write
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    rows = []
    for name, fn in probes.items():
        fn()
        torch.cuda.synchronize()
        idle = per_call_us(fn, args.calls)
        torch.cuda.synchronize()
        for _ in range(20):
            torch.mm(a, a)  # about 30 ms of queued work
        busy = per_call_us(fn, args.calls)
        torch.cuda.synchronize()
        rows.append((name, idle, busy))
    worst = dist.gather_from_all(rows)
    if dist.rank() == 0:
        print(f"{'operation':48s} {'idle us':>9s} {'busy us':>9s}  (max over {dist.world_size()} ranks)")
        for i, (name, _, _) in enumerate(rows):
            print(f"{name:48s} {max(w[i][1] for w in worst):9.1f} {max(w[i][2] for w in worst):9.1f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(ARGS)
