"""cuBLASLt through ctypes: list the algorithms cuBLASLt offers for one GEMM, time them, run the fastest.

torch asks cuBLASLt's heuristic for one algorithm per GEMM and runs it. For the row chunks of the fused
segments that pick can be a slower kernel than for the unchunked GEMM (on 2x H200 the heuristic gave
4096-row chunks a 256x128 tile at ~756 TFLOP/s where 8192 rows got 192x192 tiles at ~858), so tuning
(``tuning.tune``) records the GEMMs a plan runs (``recording``), times the heuristic's other candidates
on scratch operands of the same shapes (``tune``), and keeps one only where it beats torch's own call.
``_linear`` in ``overlap.py`` then runs the kept algorithm (``run_chosen``); every other GEMM stays
torch's. Only 2-D bf16/fp16 GEMMs ``out = x @ w.T (+ bias) (then tanh-GELU)`` with row-major operands
are handled. Nothing here runs on the CPU; the library is loaded on first use.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import glob
import os
import sys

import torch

_COMPUTE_32F = 68  # cublasComputeType_t CUBLAS_COMPUTE_32F
_R_32F = 0  # cudaDataType_t
_DATA_TYPES = {torch.bfloat16: 14, torch.float16: 2}  # CUDA_R_16BF, CUDA_R_16F
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_OP_N, _OP_T = 0, 1
_EPILOGUES = {"none": 1, "bias": 4, "gelu_bias": 36}  # CUBLASLT_EPILOGUE_DEFAULT, _BIAS, _GELU_BIAS
_PREF_MAX_WORKSPACE_BYTES = 1
_WORKSPACE_BYTES = 32 << 20
CANDIDATES = 16  # algorithms asked of the heuristic per GEMM
MARGIN = 0.02  # a candidate replaces torch's call only if it is at least this much faster


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


@dataclasses.dataclass(frozen=True)
class Problem:
    """One GEMM ``out[m, n] = epilogue(x[m, k] @ w[n, k].T + bias)``, row-major, with its leading dims."""

    m: int
    n: int
    k: int
    dtype: torch.dtype
    epilogue: str  # "none", "bias" or "gelu_bias"
    ld_x: int
    ld_w: int
    ld_out: int

    @staticmethod
    def of(x2: torch.Tensor, weight: torch.Tensor, bias, gelu: bool, out: torch.Tensor) -> Problem | None:
        """The problem of ``_linear``'s arguments, or None where cuBLASLt through here does not apply."""
        if not (x2.is_cuda and x2.dtype in _DATA_TYPES and weight.dtype == x2.dtype == out.dtype
                and x2.stride(1) == weight.stride(1) == out.stride(1) == 1 and (bias is None or bias.dtype == x2.dtype)
                and (not gelu or bias is not None)):
            return None
        epilogue = "gelu_bias" if gelu else ("none" if bias is None else "bias")
        return Problem(x2.shape[0], weight.shape[0], x2.shape[1], x2.dtype, epilogue,
                       x2.stride(0), weight.stride(0), out.stride(0))

    def scratch(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Random operands of this problem's shapes and leading dims (never zeros: they time faster)."""
        x = torch.randn(self.m, self.ld_x, dtype=self.dtype, device=device)[:, :self.k]
        w = torch.randn(self.n, self.ld_w, dtype=self.dtype, device=device)[:, :self.k]
        bias = None if self.epilogue == "none" else torch.randn(self.n, dtype=self.dtype, device=device)
        out = torch.empty(self.m, self.ld_out, dtype=self.dtype, device=device)[:, :self.n]
        return x, w, bias, out


class _Library:
    """The cuBLASLt entry points used here."""

    def __init__(self):
        lib = _load()
        p, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        pp = ctypes.POINTER(p)
        self.create = self._bind(lib, "cublasLtCreate", (pp,))
        self.desc_create = self._bind(lib, "cublasLtMatmulDescCreate", (pp, i, i))
        self.desc_set = self._bind(lib, "cublasLtMatmulDescSetAttribute", (p, i, p, sz))
        self.layout_create = self._bind(lib, "cublasLtMatrixLayoutCreate",
                                        (pp, i, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64))
        self.pref_create = self._bind(lib, "cublasLtMatmulPreferenceCreate", (pp,))
        self.pref_set = self._bind(lib, "cublasLtMatmulPreferenceSetAttribute", (p, i, p, sz))
        self.heuristic = self._bind(lib, "cublasLtMatmulAlgoGetHeuristic",
                                    (p, p, p, p, p, p, p, i, ctypes.POINTER(_Heuristic), ctypes.POINTER(i)))
        self.matmul = self._bind(lib, "cublasLtMatmul",
                                 (p, p, p, p, p, p, p, p, p, p, p, p, ctypes.POINTER(_Algo), p, sz, p))

    @staticmethod
    def _bind(lib, name, argtypes):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
        return fn


def _load() -> ctypes.CDLL:
    """libcublasLt: the copy torch already mapped (its path from /proc/self/maps), else by name."""
    torch.cuda.current_blas_handle()  # makes torch load and initialise cuBLAS(Lt)
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith("libcublasLt.so"):
                return ctypes.CDLL(path)
    names = ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]
    names += [f for d in sys.path for f in sorted(glob.glob(os.path.join(d, "nvidia", "*", "lib", "libcublasLt.so*")))]
    for name in names:
        with contextlib.suppress(OSError):
            return ctypes.CDLL(name)
    raise OSError("libcublasLt could not be loaded")


@functools.cache
def _library() -> _Library:
    return _Library()


def _check(status: int, what: str) -> None:
    if status:
        raise RuntimeError(f"{what} failed with cublasStatus_t {status}")


class Gemm:
    """The cuBLASLt descriptors of one ``Problem`` (created once, kept for the process)."""

    def __init__(self, problem: Problem):
        lib, v = _library(), ctypes.c_void_p
        self.problem = problem
        dtype = _DATA_TYPES[problem.dtype]
        self.desc = v()
        _check(lib.desc_create(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F), "cublasLtMatmulDescCreate")
        # Column-major view: out.T[n, m] = w[n, k] (stored as k x n, transposed) @ x.T[k, m].
        epilogue = _EPILOGUES[problem.epilogue]
        for attr, value in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N), (_DESC_EPILOGUE, epilogue)):
            self._set(attr, ctypes.c_int32(value))
        self.a, self.b, self.d = v(), v(), v()
        for layout, rows, cols, ld in ((self.a, problem.k, problem.n, problem.ld_w),
                                       (self.b, problem.k, problem.m, problem.ld_x),
                                       (self.d, problem.n, problem.m, problem.ld_out)):
            _check(lib.layout_create(ctypes.byref(layout), dtype, rows, cols, ld), "cublasLtMatrixLayoutCreate")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def _set(self, attr: int, value) -> None:
        _check(_library().desc_set(self.desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
               "cublasLtMatmulDescSetAttribute")

    def candidates(self, count: int = CANDIDATES) -> list[_Algo]:
        """Up to ``count`` algorithms in the heuristic's order (its first is what torch would run)."""
        lib = _library()
        pref = ctypes.c_void_p()
        _check(lib.pref_create(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        limit = ctypes.c_uint64(_WORKSPACE_BYTES)
        _check(lib.pref_set(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit), ctypes.sizeof(limit)),
               "cublasLtMatmulPreferenceSetAttribute")
        results, found = (_Heuristic * count)(), ctypes.c_int(0)
        _check(lib.heuristic(_handle(), self.desc, self.a, self.b, self.d, self.d, pref, count, results,
                             ctypes.byref(found)), "cublasLtMatmulAlgoGetHeuristic")
        return [results[i].algo for i in range(found.value) if results[i].state == 0]

    def run(self, algo: _Algo, x2: torch.Tensor, weight: torch.Tensor, bias, out: torch.Tensor) -> None:
        """Enqueue the GEMM with ``algo`` on the current stream."""
        stream = torch.cuda.current_stream(x2.device)
        if bias is not None:
            self._set(_DESC_BIAS_POINTER, ctypes.c_void_p(bias.data_ptr()))
        _check(_library().matmul(_handle(), self.desc, ctypes.byref(self.alpha), weight.data_ptr(), self.a,
                                 x2.data_ptr(), self.b, ctypes.byref(self.beta), out.data_ptr(), self.d,
                                 out.data_ptr(), self.d, ctypes.byref(algo), _workspace(stream).data_ptr(),
                                 _WORKSPACE_BYTES, stream.cuda_stream), "cublasLtMatmul")


@functools.cache
def _handle_of(device: int) -> ctypes.c_void_p:
    handle = ctypes.c_void_p()
    with torch.cuda.device(device):
        _check(_library().create(ctypes.byref(handle)), "cublasLtCreate")
    return handle


def _handle() -> ctypes.c_void_p:
    return _handle_of(torch.cuda.current_device())


_workspaces: dict[int, torch.Tensor] = {}


def _workspace(stream: torch.cuda.Stream) -> torch.Tensor:
    """One workspace per stream, so GEMMs on two streams never share one."""
    ws = _workspaces.get(stream.cuda_stream)
    if ws is None:
        with torch.cuda.stream(stream):
            ws = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=stream.device)
        _workspaces[stream.cuda_stream] = ws
    return ws


# --------------------------------------------------------------------------------------------------
# The choice: recorded problems, timed candidates, the kept algorithm per problem
# --------------------------------------------------------------------------------------------------

_chosen: dict[Problem, tuple[Gemm, _Algo]] = {}
_tuned: set[Problem] = set()  # timed already, whether a candidate was kept or torch's call won
_recorded: list[set[Problem]] = []


@contextlib.contextmanager
def recording():
    """Collect the ``Problem`` of every GEMM ``_linear`` runs inside the block (into the yielded set)."""
    seen: set[Problem] = set()
    _recorded.append(seen)
    try:
        yield seen
    finally:
        _recorded.remove(seen)


def run_chosen(x2, weight, bias, gelu: bool, out) -> bool:
    """Run ``out = x2 @ weight.T (+ bias) (tanh-GELU)`` with the algorithm ``tune`` kept for its problem;
    False (nothing run) where there is none and torch's call should run."""
    if not (_chosen or _recorded):
        return False
    problem = Problem.of(x2, weight, bias, gelu, out)
    if problem is None:
        return False
    for seen in _recorded:
        seen.add(problem)
    kept = _chosen.get(problem)
    if kept is None or not _aligned(x2, weight, bias, out):
        return False
    kept[0].run(kept[1], x2, weight, bias, out)
    return True


def _aligned(*tensors) -> bool:
    return all(t is None or t.data_ptr() % 16 == 0 for t in tensors)


def torch_linear(x2, weight, bias, gelu: bool, out) -> None:
    """torch's own call for the problem (what a kept algorithm must beat)."""
    if gelu:
        torch._addmm_activation(bias, x2, weight.t(), use_gelu=True, out=out)
    elif bias is None:
        torch.mm(x2, weight.t(), out=out)
    else:
        torch.addmm(bias, x2, weight.t(), out=out)


def _time_ms(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def time_candidates(problem: Problem, device, iters: int = 10,
                    warmup: int = 3) -> tuple[float, list[tuple[float, _Algo]]]:
    """torch's time for ``problem`` and each candidate's (time, algorithm), on random scratch operands.
    A candidate whose output differs from torch's beyond bf16 rounding is left out."""
    gemm = Gemm(problem)
    x, w, bias, out = problem.scratch(device)
    gelu = problem.epilogue == "gelu_bias"
    reference = out.clone()
    torch_linear(x, w, bias, gelu, reference)
    torch_ms = _time_ms(lambda: torch_linear(x, w, bias, gelu, out), iters, warmup)
    timed = []
    for algo in gemm.candidates():
        try:
            out.fill_(float("nan"))
            gemm.run(algo, x, w, bias, out)
            if not torch.allclose(out.float(), reference.float(), rtol=2e-2, atol=2e-2 * problem.k ** 0.5):
                continue
            timed.append((_time_ms(lambda a=algo: gemm.run(a, x, w, bias, out), iters, warmup), algo))
        except RuntimeError:  # an algorithm the heuristic listed but that cannot run this problem
            continue
    return torch_ms, timed


def tune(problems, device) -> dict[Problem, tuple[float, float]]:
    """Time each problem's candidates against torch's call and keep the fastest where it wins by
    ``MARGIN``; returns {problem: (torch ms, kept ms or torch's)}. Problems tuned before are skipped."""
    report = {}
    for problem in sorted(set(problems) - _tuned, key=repr):
        torch_ms, timed = time_candidates(problem, device)
        _tuned.add(problem)
        best_ms, best = min(timed, key=lambda t: t[0], default=(torch_ms, None))
        if best is not None and best_ms < torch_ms * (1 - MARGIN):
            _chosen[problem] = (Gemm(problem), best)
        report[problem] = (torch_ms, min(best_ms, torch_ms))
    return report


def forget() -> None:
    """Drop every kept algorithm (torch's calls run again) and what was timed."""
    _chosen.clear()
    _tuned.clear()
