"""cuBLASLt through ctypes, for the one GEMM torch has no call for: ``out = c + x @ w.T`` with ``c``
and ``out`` distinct tensors.

torch's ``addmm(c, x, w.t(), out=out)`` copies ``c`` into ``out`` first (a pass over the output) and
then runs the GEMM with beta=1 in place. cuBLASLt reads C and writes D as separate matrices, so the
fused reduce_scatter's ring (``overlap._symm_ring_linear_reduce_scatter``) adds the partial a peer
sent inside the GEMM, as its C operand, with no pass of its own. The algorithm is the heuristic's
first pick for the operands' shapes, strides and pointer alignments, as torch's own calls use. Nothing
here runs on the CPU; libcublasLt (the copy torch mapped) is loaded on first use, and where it cannot
be, or an operand does not suit it, ``addmm_into`` falls back to torch's ``addmm`` (same result, one
more pass).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os

import torch

_COMPUTE_32F = 68  # cublasComputeType_t CUBLAS_COMPUTE_32F
_R_32F = 0  # cudaDataType_t CUDA_R_32F (the scale type of CUBLAS_COMPUTE_32F)
_DATA_TYPES = {torch.bfloat16: 14, torch.float16: 2, torch.float32: 0}  # CUDA_R_16BF, CUDA_R_16F, CUDA_R_32F
_DESC_TRANSA, _DESC_TRANSB = 3, 4  # cublasLtMatmulDescAttributes_t
_OP_N, _OP_T = 0, 1
_PREF_MAX_WORKSPACE_BYTES = 1  # cublasLtMatmulPreferenceAttributes_t
_PREF_MIN_ALIGNMENT = (5, 6, 7, 8)  # ... _MIN_ALIGNMENT_{A,B,C,D}_BYTES: the heuristic assumes 256 otherwise
_WORKSPACE_BYTES = 32 << 20  # what cuBLAS recommends on Hopper


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


class _Gemm:
    """The descriptors and chosen algorithm of ``d[m, n] = c[m, n] + x[m, k] @ w[n, k].T`` (row-major,
    with these leading dims and pointer alignments), created once per shape for the process."""

    def __init__(self, device: int, dtype: torch.dtype, m, n, k, ld_x, ld_w, ld_c, ld_d,
                 alignments: tuple[int, int, int, int]):
        lib, v = _library(), ctypes.c_void_p
        self.desc = v()
        _check(lib.desc_create(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F), "cublasLtMatmulDescCreate")
        for attr, op in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N)):
            value = ctypes.c_int32(op)
            _check(lib.desc_set(self.desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
                   "cublasLtMatmulDescSetAttribute")
        # Column-major view: d.T[n, m] = w[n, k] (stored as k x n, transposed) @ x.T[k, m] + c.T[n, m].
        self.a, self.b, self.c, self.d = v(), v(), v(), v()
        for layout, rows, cols, ld in ((self.a, k, n, ld_w), (self.b, k, m, ld_x), (self.c, n, m, ld_c),
                                       (self.d, n, m, ld_d)):
            _check(lib.layout_create(ctypes.byref(layout), _DATA_TYPES[dtype], rows, cols, ld),
                   "cublasLtMatrixLayoutCreate")
        pref = v()
        _check(lib.pref_create(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        limit = ctypes.c_uint64(_WORKSPACE_BYTES)
        _check(lib.pref_set(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit), ctypes.sizeof(limit)),
               "cublasLtMatmulPreferenceSetAttribute")
        for attr, align in zip(_PREF_MIN_ALIGNMENT, alignments, strict=True):  # A = w, B = x, C, D
            value = ctypes.c_uint32(align)
            _check(lib.pref_set(pref, attr, ctypes.byref(value), ctypes.sizeof(value)),
                   "cublasLtMatmulPreferenceSetAttribute")
        result, found = _Heuristic(), ctypes.c_int(0)
        _check(lib.heuristic(_handle(device), self.desc, self.a, self.b, self.c, self.d, pref, 1,
                             ctypes.byref(result), ctypes.byref(found)), "cublasLtMatmulAlgoGetHeuristic")
        if found.value < 1:
            raise RuntimeError("cublasLtMatmulAlgoGetHeuristic found no algorithm")
        self.algo, self.device = result.algo, device
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(1.0)

    def run(self, c: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
        stream = torch.cuda.current_stream(self.device)
        _check(_library().matmul(_handle(self.device), self.desc, ctypes.byref(self.alpha), weight.data_ptr(),
                                 self.a, x2.data_ptr(), self.b, ctypes.byref(self.beta), c.data_ptr(), self.c,
                                 out.data_ptr(), self.d, ctypes.byref(self.algo), _workspace(stream).data_ptr(),
                                 _WORKSPACE_BYTES, stream.cuda_stream), "cublasLtMatmul")


_gemms: dict[tuple, _Gemm] = {}


def _suits(*tensors: torch.Tensor) -> bool:
    """Row-major 2-D operands of one supported dtype, 16-byte aligned, on one CUDA device."""
    t0 = tensors[0]
    return (t0.is_cuda and t0.dtype in _DATA_TYPES
            and all(t.dim() == 2 and t.dtype == t0.dtype and t.device == t0.device and t.stride(1) == 1
                    and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors))


def addmm_into(c: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = c + x2 @ weight.T`` on the current stream, ``c`` read as the GEMM's C operand (one pass
    over the output, where torch's ``addmm`` takes two). ``c`` and ``out`` have ``out``'s shape; they
    may be the same tensor but must not overlap otherwise."""
    if not (_suits(c, x2, weight, out) and _library() is not None):
        return torch.addmm(c, x2, weight.t(), out=out)
    alignments = tuple(min(256, t.data_ptr() & -t.data_ptr()) for t in (weight, x2, c, out))
    key = (out.device.index, out.dtype, *out.shape, x2.shape[1], x2.stride(0), weight.stride(0), c.stride(0),
           out.stride(0), alignments)
    gemm = _gemms.get(key)
    if gemm is None:
        gemm = _gemms[key] = _Gemm(*key)
    gemm.run(c, x2, weight, out)
    return out
