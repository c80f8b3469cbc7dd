"""cuBLASLt through ctypes: the GEMMs of the fused segments (both modes), with two things torch's
calls cannot do.

- **C apart from D.** ``out = c + x @ w.T`` with ``c`` and ``out`` distinct tensors: torch's
  ``addmm(c, x, w.t(), out=out)`` copies ``c`` into ``out`` first (a pass over the output) and then
  runs the GEMM in place. The fused reduce_scatter's ring (``overlap._symm_ring_linear_reduce_scatter``)
  adds the partial a peer sent inside the GEMM, as its C operand, with no pass of its own.
- **The algorithm measured per GEMM shape.** torch runs the heuristic's first pick. On 2x H200 another
  of its top picks ran up to 12% faster on some of the MLP's GEMMs, whole and chunked
  (docs/performance.md, round 11). ``search`` times the candidates of the GEMMs a program runs (tuning
  calls it when a plan is compiled on the GPU) and keeps the fastest whose output equals the first
  pick's bit for bit, so a search changes speed, never values. Unsearched GEMMs run the first pick.

``linear_into`` covers what the fused kernels ask of a GEMM: plain, bias, bias + tanh-GELU (cuBLASLt's
GELU_BIAS epilogue) or a C operand. Nothing here runs on the CPU; libcublasLt (the copy torch mapped)
is loaded on first use, and where it cannot be, or an operand does not suit it (not row-major, not
16-byte aligned, an unsupported dtype), the same result comes from torch's calls.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
from collections.abc import Callable, Iterator

import torch

_COMPUTE_32F = 68  # cublasComputeType_t CUBLAS_COMPUTE_32F
_R_32F = 0  # cudaDataType_t CUDA_R_32F (the scale type of CUBLAS_COMPUTE_32F)
_DATA_TYPES = {torch.bfloat16: 14, torch.float16: 2, torch.float32: 0}  # CUDA_R_16BF, CUDA_R_16F, CUDA_R_32F
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8  # cublasLtMatmulDescAttributes_t
_OP_N, _OP_T = 0, 1
_EPILOGUE_DEFAULT, _EPILOGUE_BIAS, _EPILOGUE_GELU_BIAS = 1, 4, 36  # cublasLtEpilogue_t
_PREF_MAX_WORKSPACE_BYTES = 1  # cublasLtMatmulPreferenceAttributes_t; 5-8: minimum alignment of A, B, C, D
_PREF_MIN_ALIGNMENT = (5, 6, 7, 8)
_WORKSPACE_BYTES = 32 << 20  # what cuBLAS recommends on Hopper
CANDIDATES = 8  # the heuristic's top picks that ``search`` times (the probe of round 11 found the
#                 fastest among the first three on every GEMM of the MLP on 2x H200)


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class _Library:
    """The cuBLASLt entry points used here."""

    def __init__(self, lib: ctypes.CDLL):
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


@functools.cache
def _library() -> _Library | None:
    """libcublasLt as torch mapped it (its path from /proc/self/maps), or None where it is not there."""
    torch.cuda.current_blas_handle()  # makes torch load and initialise cuBLAS(Lt)
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith("libcublasLt.so"):
                return _Library(ctypes.CDLL(path))
    return None


def _check(status: int, what: str) -> None:
    if status:
        raise RuntimeError(f"{what} failed with cublasStatus_t {status}")


@functools.cache
def _handle(device: int) -> ctypes.c_void_p:
    handle = ctypes.c_void_p()
    with torch.cuda.device(device):
        _check(_library().create(ctypes.byref(handle)), "cublasLtCreate")
    return handle


@functools.cache
def _workspace(stream: torch.cuda.Stream) -> torch.Tensor:
    """One workspace per stream, so GEMMs on two streams never share one."""
    with torch.cuda.stream(stream):
        return torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=stream.device)


def _alignment(t: torch.Tensor) -> int:
    """The largest power of two up to 256 that divides the address (cuBLASLt's alignment classes)."""
    ptr = t.data_ptr()
    return min(256, ptr & -ptr)


class _Gemm:
    """``d[m, n] = epilogue(x[m, k] @ w[n, k].T + c[m, n])`` (row-major, with these leading dims; no
    ``c`` term without ``has_c``): the descriptors, created once per key for the process, and the
    algorithm in use (the heuristic's first pick until ``search`` measures the others)."""

    def __init__(self, key: tuple):
        device, dtype, m, n, k, ld_x, ld_w, ld_c, ld_d, epilogue, has_c, aligns, bias_ptr = key
        self.key, self.device, self.epilogue = key, device, epilogue
        lib, v = _library(), ctypes.c_void_p
        self.desc = v()
        _check(lib.desc_create(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F), "cublasLtMatmulDescCreate")
        for attr, value in ((_DESC_TRANSA, ctypes.c_int32(_OP_T)), (_DESC_TRANSB, ctypes.c_int32(_OP_N)),
                            (_DESC_EPILOGUE, ctypes.c_uint32(epilogue))):
            self._set(attr, value)
        if bias_ptr:  # the heuristic reads the bias pointer's alignment
            self._set(_DESC_BIAS_POINTER, ctypes.c_void_p(bias_ptr))
        # Column-major view: d.T[n, m] = w[n, k] (stored as k x n, transposed) @ x.T[k, m] + c.T[n, m].
        self.a, self.b, self.c, self.d = v(), v(), v(), v()
        for layout, rows, cols, ld in ((self.a, k, n, ld_w), (self.b, k, m, ld_x),
                                       (self.c, n, m, ld_c if has_c else ld_d), (self.d, n, m, ld_d)):
            _check(lib.layout_create(ctypes.byref(layout), _DATA_TYPES[dtype], rows, cols, ld),
                   "cublasLtMatrixLayoutCreate")
        self.pref = v()
        _check(lib.pref_create(ctypes.byref(self.pref)), "cublasLtMatmulPreferenceCreate")
        for attr, value in ((_PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(_WORKSPACE_BYTES)),
                            *zip(_PREF_MIN_ALIGNMENT, (ctypes.c_uint32(a) for a in aligns))):
            _check(lib.pref_set(self.pref, attr, ctypes.byref(value), ctypes.sizeof(value)),
                   "cublasLtMatmulPreferenceSetAttribute")
        self.algo = self.candidates(1)[0].algo
        self.searched, self.note = False, ""
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(1.0 if has_c else 0.0)

    def _set(self, attr: int, value) -> None:
        _check(_library().desc_set(self.desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
               "cublasLtMatmulDescSetAttribute")

    def candidates(self, count: int) -> list[_Heuristic]:
        """The heuristic's first ``count`` picks that fit the workspace, best first."""
        results, found = (_Heuristic * count)(), ctypes.c_int(0)
        _check(_library().heuristic(_handle(self.device), self.desc, self.a, self.b, self.c, self.d, self.pref,
                                    count, results, ctypes.byref(found)), "cublasLtMatmulAlgoGetHeuristic")
        picks = [results[i] for i in range(found.value) if results[i].workspace_size <= _WORKSPACE_BYTES]
        if not picks:
            raise RuntimeError("cublasLtMatmulAlgoGetHeuristic found no algorithm")
        return picks

    def run(self, x2, weight, out, bias=None, c=None, algo: _Algo | None = None) -> None:
        if bias is not None:
            self._set(_DESC_BIAS_POINTER, ctypes.c_void_p(bias.data_ptr()))
        stream = torch.cuda.current_stream(self.device)
        c_ptr = out.data_ptr() if c is None else c.data_ptr()
        _check(_library().matmul(_handle(self.device), self.desc, ctypes.byref(self.alpha), weight.data_ptr(),
                                 self.a, x2.data_ptr(), self.b, ctypes.byref(self.beta), c_ptr, self.c,
                                 out.data_ptr(), self.d, ctypes.byref(algo or self.algo),
                                 _workspace(stream).data_ptr(), _WORKSPACE_BYTES, stream.cuda_stream),
               "cublasLtMatmul")

    def search(self, bias_alignment: int | None, time_ms, rounds: int) -> None:
        """``search`` for this GEMM, on random operands of its layout."""
        self.searched = True
        picks = self.candidates(CANDIDATES)
        x2, weight, out, bias, c = _scratch(self.key, bias_alignment)
        self.run(x2, weight, out, bias, c, picks[0].algo)
        first, same = out.clone(), []
        for p in picks:
            self.run(x2, weight, out, bias, c, p.algo)
            if torch.equal(out, first):
                same.append(p)
        ms = [math.inf] * len(same)
        for _ in range(rounds if len(same) > 1 else 0):
            for i, p in enumerate(same):
                ms[i] = min(ms[i], time_ms(lambda algo=p.algo: self.run(x2, weight, out, bias, c, algo)))
        best = min(range(len(same)), key=ms.__getitem__)
        if best:
            self.algo = same[best].algo
            self.note = (f"gemm {self.describe()}: algorithm {picks.index(same[best]) + 1} of {len(picks)} "
                         f"{ms[best]:.3f} ms, the heuristic's first {ms[0]:.3f} ms")

    def describe(self) -> str:
        _, dtype, m, n, k, *_ = self.key
        what = {_EPILOGUE_DEFAULT: "", _EPILOGUE_BIAS: " +bias", _EPILOGUE_GELU_BIAS: " +bias+gelu"}[self.epilogue]
        return f"{m}x{n}x{k}{what}{' +C' if self.beta.value else ''} {str(dtype).removeprefix('torch.')}"


_gemms: dict[tuple, _Gemm] = {}
_recorders: list[set] = []


def _suits(*tensors: torch.Tensor) -> bool:
    """Row-major 2-D operands of one supported dtype, none empty, 16-byte aligned, on one CUDA device."""
    t0 = tensors[0]
    return (t0.is_cuda and t0.dtype in _DATA_TYPES
            and all(t.dim() == 2 and t.numel() and t.dtype == t0.dtype and t.device == t0.device
                    and t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
                    for t in tensors))


def _torch_linear_into(x2, weight, out, bias, gelu, c) -> torch.Tensor:
    """``linear_into`` through torch's calls (the same values; C costs a pass of its own)."""
    wt = weight.t()
    if c is not None:
        return torch.addmm(c, x2, wt, out=out)
    if gelu and x2.is_cuda:  # on CUDA its GELU is the tanh form, as cuBLASLt's; on the CPU the exact one
        return torch._addmm_activation(bias, x2, wt, use_gelu=True, out=out)
    if gelu:
        return torch.ops.aten.gelu_(torch.addmm(bias, x2, wt, out=out), approximate="tanh")
    if bias is not None:
        return torch.addmm(bias, x2, wt, out=out)
    return torch.mm(x2, wt, out=out)


def linear_into(x2: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, *, bias: torch.Tensor | None = None,
                gelu: bool = False, c: torch.Tensor | None = None) -> torch.Tensor:
    """``out = x2 @ weight.T`` plus ``bias`` (then tanh-GELU if ``gelu``) or plus ``c`` read as the GEMM's
    C operand (one pass over the output), on the current stream. ``c`` has ``out``'s shape; it may be
    ``out`` itself but must not overlap it otherwise. ``gelu`` needs a bias; ``c`` takes neither."""
    if (gelu and bias is None) or (c is not None and (bias is not None or gelu)):
        raise ValueError("linear_into: gelu needs a bias, and c takes neither a bias nor gelu")
    mats = (x2, weight, out) if c is None else (x2, weight, out, c)
    if not (_suits(*mats) and (bias is None or (bias.dim() == 1 and bias.stride(0) == 1 and bias.dtype == out.dtype
                                                 and bias.device == out.device and bias.data_ptr() % 16 == 0))
            and _library() is not None):
        return _torch_linear_into(x2, weight, out, bias, gelu, c)
    epilogue = _EPILOGUE_GELU_BIAS if gelu else _EPILOGUE_BIAS if bias is not None else _EPILOGUE_DEFAULT
    aligns = (_alignment(weight), _alignment(x2), _alignment(out if c is None else c), _alignment(out))
    key = (out.device.index, out.dtype, *out.shape, x2.shape[1], x2.stride(0), weight.stride(0),
           None if c is None else c.stride(0), out.stride(0), epilogue, c is not None, aligns,
           None if bias is None else _alignment(bias))
    gemm = _gemms.get(key)
    if gemm is None:
        gemm = _gemms[key] = _Gemm(key[:-1] + (0 if bias is None else bias.data_ptr(),))
    for keys in _recorders:
        keys.add(key)
    gemm.run(x2, weight, out, bias, c)
    return out


@contextlib.contextmanager
def recording() -> Iterator[set]:
    """The keys of the cuBLASLt GEMMs that run within (for ``search``)."""
    keys: set = set()
    _recorders.append(keys)
    try:
        yield keys
    finally:
        _recorders.pop()  # the innermost (recordings nest; a set compares by value, so no remove)


def search(keys, time_ms: Callable[[Callable[[], None]], float], rounds: int = 2) -> None:
    """Measure the heuristic's top ``CANDIDATES`` algorithms of each GEMM in ``keys`` not searched yet
    (``time_ms(fn)``: GPU ms per call; the min of ``rounds`` interleaved timings) and keep the fastest
    whose output equals the first pick's bit for bit. Local to this process (no collective); ``notes``
    reports what changed."""
    for key in sorted(keys, key=str):
        if not _gemms[key].searched:
            _gemms[key].search(key[-1], time_ms, rounds)


def notes(keys) -> list[str]:
    """What ``search`` changed among the GEMMs of ``keys``."""
    return sorted(_gemms[key].note for key in keys if _gemms[key].note)


def _scratch(key: tuple, bias_alignment: int | None) -> tuple:
    """Random operands with ``key``'s shapes and leading dims (fresh memory, at least as aligned)."""
    device, dtype, m, n, k, ld_x, ld_w, ld_c, ld_d, _, has_c, _, _ = key
    gen = torch.Generator(f"cuda:{device}").manual_seed(0)
    def rand(rows, ld, cols):
        return (torch.randn(rows, ld, dtype=dtype, device=f"cuda:{device}", generator=gen) / math.sqrt(k))[:, :cols]
    x2, weight, out = rand(m, ld_x, k), rand(n, ld_w, k), rand(m, ld_d, n)
    bias = None if bias_alignment is None else rand(1, n, n)[0]
    return x2, weight, out, bias, (rand(m, ld_c, n) if has_c else None)
