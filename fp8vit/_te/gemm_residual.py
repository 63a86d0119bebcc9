"""fp8vit's own FP8 GEMMs in TE's modules: the residual add in the GEMM before it (lever 61) and
the input-gradient GEMMs, each on the fastest of cuBLASLt's candidate algorithms (lever 62, on
lever 60's microbenchmark; docs/performance.md).

A ViT block adds each branch to the residual stream: ``x + proj(o)``, ``x + fc2(h)``. TE runs the
GEMM, then torch reads both ``[T, C]`` bf16 tensors and writes their sum: at ViT-L/16 b128 on an
H100, 53 us a call, 48 calls, 2.5 ms of a step. cuBLASLt's epilogue adds a matrix C itself
(``D = A B + bias + beta C``) for 2 bytes an element more read: proj's GEMM with the residual in it
takes 72.5 us against 59.2 + 53.1 apart (``docs/results/levers/gemm_algo_lever60_h100.log``). TE can
only accumulate in place (C = D), which would overwrite the block input that norm1's backward
keeps; this module makes the call itself, with C the residual and D a new tensor.

How it fits: while :func:`set_residual_gemm` has it on (fp8vit's graph capture by default; eager
steps where asked), TE's ``general_gemm`` in its ``Linear``, ``LayerNormMLP`` and
``LayerNormLinear`` modules is :func:`_general_gemm`. A block offers its stream around a branch
(:func:`into_residual`); the branch's forward GEMM that matches it (per-tensor FP8 inputs, a bf16
output of the residual's shape from the expected inner width, a bf16 bias or none, no output
quantizer, no Userbuffers) takes it, and the block joins the gradients with :func:`residual_added`.
The backward's input-gradient GEMMs of TE's ``Linear``, ``LayerNormLinear`` and ``LayerNormMLP``
(``dx = dy W``: per-tensor FP8, a bf16 output, no bias, no quantized output) run here too. Every
other call, and any that cuBLASLt refuses, runs TE's own, and the block adds as before.

Algorithms: TE runs the one cuBLASLt's heuristic puts first. At ViT-L/16 b128 on an H100 another of
its first eight is 8-36 us faster for proj's forward and input gradient and fc2's input gradient
(``docs/results/levers/gemm_algo_lever60_h100.log``), so each GEMM form, the first time it runs
outside a graph capture, times the heuristic's first :data:`CANDIDATES` on its real operands
(CUDA events, :data:`TIMED_RUNS` runs each) and keeps the fastest, as ``cudnn.benchmark`` does.
Under ``torch.use_deterministic_algorithms(True)``, during a capture, or after
``set_algorithm_search(False)`` it keeps the heuristic's first. One process-wide setting; the
descriptors are not shared across threads.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import glob
import os
import warnings
from typing import Any, ContextManager, Dict, Iterator, Optional, Tuple

import torch

from ..errors import Check
from .loader import te_module, te_status
from .route import Route

__all__ = ["residual_gemm_support", "set_residual_gemm", "residual_gemm", "residual_gemm_enabled", "into_residual",
           "residual_added", "set_algorithm_search", "CANDIDATES", "TIMED_RUNS",
           # cuBLASLt through ctypes, which docs/perf/gemm_algo_bench.py builds its GEMMs on too
           "load_cublaslt", "HeuristicResult"]

# cuBLASLt's enums (cublasLt.h, cublas_api.h, library_types.h)
_R_16BF, _R_32F, _R_8F_E4M3, _R_8F_E5M2 = 14, 0, 28, 29
_COMPUTE_32F, _OP_N, _OP_T = 68, 0, 1
_TRANSA, _TRANSB, _EPILOGUE, _BIAS_POINTER, _A_SCALE, _B_SCALE, _FAST_ACCUM, _BIAS_TYPE = 3, 4, 7, 8, 17, 18, 25, 26
_EPI_DEFAULT, _EPI_BIAS = 1, 4
_PREF_MAX_WORKSPACE, _PREF_ALIGNMENTS = 1, (5, 6, 7, 8)  # MIN_ALIGNMENT_{A,B,C,D}_BYTES
_MODULES = ("transformer_engine.pytorch.module.linear", "transformer_engine.pytorch.module.layernorm_mlp",
            "transformer_engine.pytorch.module.layernorm_linear")  # the last: its input gradient only
CANDIDATES = 8  # the heuristic's first algorithms a GEMM form times (lever 60: the best were in the first 8)
TIMED_RUNS = 3  # runs each, after one untimed


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    """``cublasLtMatmulHeuristicResult_t``: an algorithm and what it needs."""

    _fields_ = [("algo", _Algo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


@functools.lru_cache(maxsize=None)
def load_cublaslt() -> Any:
    """The cuBLASLt torch loaded (its first cuBLAS handle loads it), with the argument types of the
    calls made here (ctypes would pass 64-bit values as C ints)."""
    torch.cuda.current_blas_handle()
    lib = None
    for name in ("libcublasLt.so.13", "libcublasLt.so.12"):
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            pass
    if lib is None:  # not on the loader's path: torch's wheels keep it in site-packages/nvidia/*/lib
        site = os.path.dirname(os.path.dirname(torch.__file__))
        found = sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcublasLt.so.1[23]")))
        if not found:
            raise OSError(f"no libcublasLt.so.13 or .12 on the loader's path or under {site}/nvidia/*/lib")
        lib = ctypes.CDLL(found[-1])
    P, I, U64, I64, SZ = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
    for fn, args in {
        "cublasLtCreate": [P],
        "cublasLtMatmulDescCreate": [P, I, I],
        "cublasLtMatmulDescSetAttribute": [P, I, P, SZ],
        "cublasLtMatrixLayoutCreate": [P, I, U64, U64, I64],
        "cublasLtMatmulPreferenceCreate": [P],
        "cublasLtMatmulPreferenceSetAttribute": [P, I, P, SZ],
        "cublasLtMatmulPreferenceDestroy": [P],
        "cublasLtMatmulAlgoGetHeuristic": [P, P, P, P, P, P, P, I, P, P],
        "cublasLtMatmul": [P, P, P, P, P, P, P, P, P, P, P, P, P, P, SZ, P],
        "cublasLtMatmulAlgoConfigGetAttribute": [P, I, P, SZ, P],
    }.items():
        getattr(lib, fn).argtypes, getattr(lib, fn).restype = args, I
    lib.cublasLtGetVersion.argtypes, lib.cublasLtGetVersion.restype = [], SZ
    return lib


@functools.lru_cache(maxsize=None)
def residual_gemm_support() -> Check:
    """Whether the residual can go into the GEMM here: TE imports, the current CUDA device runs FP8
    GEMMs (compute capability 8.9 or newer) and cuBLASLt loads. Cached; ``fp8vit.clear_cache()``
    forgets it."""
    te = te_status()
    if not te.ok:
        return Check(False, te.reason)
    if not torch.cuda.is_available():
        return Check(False, "no CUDA device")
    cc = torch.cuda.get_device_capability()
    if cc < (8, 9):
        return Check(False, f"compute capability {cc[0]}.{cc[1]} has no FP8 GEMMs (8.9 or newer needed)")
    try:
        lib = load_cublaslt()
    except (OSError, AttributeError) as e:
        return Check(False, f"cuBLASLt did not load through ctypes ({type(e).__name__}: {e})")
    return Check(True, f"cuBLASLt {lib.cublasLtGetVersion()}")


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} returned status {status}")


def _alignment(ptr: int) -> int:
    """The largest power of two up to 256 that divides ``ptr`` (as TE tells cuBLASLt)."""
    a = 256
    while ptr % a:
        a //= 2
    return a


class _Plan:
    """One GEMM form's cuBLASLt descriptors and its algorithm:
    ``D[n, m] = X[n, k] @ W[m, k]^T (+ bias[m]) (+ R[n, m])`` in row-major terms, W and X
    per-tensor FP8, R and D bf16 (cuBLASLt column-major: ``D (m x n) = op_T(A) @ B + beta C``, with
    C = D and beta 0 where there is no R). Pointers (scales, bias) are set at each call; the
    descriptors are not shared across threads."""

    def __init__(self, lib: Any, handle: ctypes.c_void_p, m: int, n: int, k: int, w_type: int, x_type: int,
                 fast_accum: bool, bias: bool, residual: bool, aligns: Tuple[int, int, int, int], search: bool,
                 workspace: int):
        self.lib, self.handle = lib, handle
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F), "MatmulDescCreate")
        attrs = [(_TRANSA, ctypes.c_int32(_OP_T)), (_TRANSB, ctypes.c_int32(_OP_N)),
                 (_FAST_ACCUM, ctypes.c_int8(int(fast_accum))),
                 (_EPILOGUE, ctypes.c_int32(_EPI_BIAS if bias else _EPI_DEFAULT))]
        if bias:
            attrs.append((_BIAS_TYPE, ctypes.c_int32(_R_16BF)))
        for attr, value in attrs:
            self._set(attr, value)
        self.layouts = []
        for dtype, rows, cols in ((w_type, k, m), (x_type, k, n), (_R_16BF, m, n), (_R_16BF, m, n)):
            lay = ctypes.c_void_p()
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), dtype, ctypes.c_uint64(rows),
                                                  ctypes.c_uint64(cols), ctypes.c_int64(rows)), "MatrixLayoutCreate")
            self.layouts.append(lay)
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "MatmulPreferenceCreate")
        try:
            ws = ctypes.c_uint64(workspace)
            _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE, ctypes.byref(ws), 8),
                   "MatmulPreferenceSetAttribute")
            for attr, align in zip(_PREF_ALIGNMENTS, aligns):
                a = ctypes.c_uint32(align)
                _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(a), 4),
                       "MatmulPreferenceSetAttribute")
            want = CANDIDATES if search else 1
            results, got = (HeuristicResult * want)(), ctypes.c_int(0)
            _check(lib.cublasLtMatmulAlgoGetHeuristic(handle, self.desc, *self.layouts, pref, want, results,
                                                      ctypes.byref(got)), "MatmulAlgoGetHeuristic")
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        # the heuristic's order; the first is TE's (and the one kept where none is timed)
        self.algos = [r.algo for r in results[:got.value] if r.state == 0]
        if not self.algos:
            raise RuntimeError("cuBLASLt's heuristic has no algorithm for it")
        self.algo, self.rank = self.algos[0], 0
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(1.0 if residual else 0.0)

    def _set(self, attr: int, value: Any) -> None:
        _check(self.lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
               f"MatmulDescSetAttribute({attr})")

    def run(self, w: torch.Tensor, w_scale_inv: torch.Tensor, x: torch.Tensor, x_scale_inv: torch.Tensor,
            bias: Optional[torch.Tensor], residual: Optional[torch.Tensor], out: torch.Tensor,
            workspace: torch.Tensor, algo: Optional[_Algo] = None) -> None:
        """Enqueue ``out = x @ w^T * scales (+ bias) (+ residual)`` on torch's current stream, by
        the plan's algorithm (or ``algo``, one of :attr:`algos`)."""
        self._set(_A_SCALE, ctypes.c_void_p(w_scale_inv.data_ptr()))
        self._set(_B_SCALE, ctypes.c_void_p(x_scale_inv.data_ptr()))
        if bias is not None:
            self._set(_BIAS_POINTER, ctypes.c_void_p(bias.data_ptr()))
        lay, c = self.layouts, (out if residual is None else residual).data_ptr()  # beta 0: C is not read
        _check(self.lib.cublasLtMatmul(
            self.handle, self.desc, ctypes.byref(self.alpha), ctypes.c_void_p(w.data_ptr()), lay[0],
            ctypes.c_void_p(x.data_ptr()), lay[1], ctypes.byref(self.beta), ctypes.c_void_p(c), lay[2],
            ctypes.c_void_p(out.data_ptr()), lay[3], ctypes.byref(self.algo if algo is None else algo),
            ctypes.c_void_p(workspace.data_ptr()), ctypes.c_size_t(workspace.numel()),
            ctypes.c_void_p(torch.cuda.current_stream(out.device).cuda_stream)), "Matmul")

    def pick(self, *operands: Any) -> None:
        """Keep the fastest of :attr:`algos` on ``operands`` (:meth:`run`'s arguments; every run
        writes the same ``out``), timed by CUDA events; the heuristic's first where one alone is
        offered, inside a graph capture, or in torch's deterministic mode (the fastest is a
        timing, which may differ between runs and processes)."""
        if (len(self.algos) == 1 or torch.cuda.is_current_stream_capturing()
                or torch.are_deterministic_algorithms_enabled()):
            return
        times = []
        for algo in self.algos:
            try:
                self.run(*operands, algo=algo)  # untimed: the first run of an algorithm loads its kernel
            except RuntimeError:  # refused before anything was enqueued: not a candidate
                times.append(float("inf"))
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(TIMED_RUNS):
                self.run(*operands, algo=algo)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        self.rank = min(range(len(times)), key=times.__getitem__)
        if times[self.rank] == float("inf"):
            raise RuntimeError(f"cuBLASLt ran none of the heuristic's {len(self.algos)} algorithms")
        self.algo = self.algos[self.rank]


_HANDLES: Dict[int, ctypes.c_void_p] = {}
_PLANS: Dict[tuple, Optional[_Plan]] = {}  # None: a form cuBLASLt refused (TE runs it)
_SEARCH = [True]  # set_algorithm_search's setting


def set_algorithm_search(enabled: bool) -> bool:
    """Time the heuristic's first :data:`CANDIDATES` algorithms of each GEMM form made from now on
    and keep the fastest (True, the default), or keep its first as TE does (False: lever 62 off,
    the bench's ``-heuristic-`` variants). Forms made before keep theirs. Returns the previous
    setting."""
    old, _SEARCH[0] = _SEARCH[0], bool(enabled)
    return old


def _plan(key: tuple, workspace: torch.Tensor, operands: tuple) -> Optional[_Plan]:
    """The plan of ``key`` (``(device, m, n, k, w_type, x_type, fast_accum, bias, residual,
    aligns, search)``: the device, then :class:`_Plan`'s arguments), made on first use, its
    algorithm timed on ``operands`` (:meth:`_Plan.run`'s); None where cuBLASLt refused it."""
    if key not in _PLANS:
        lib, device = load_cublaslt(), key[0]
        if device not in _HANDLES:
            handle = ctypes.c_void_p()
            _check(lib.cublasLtCreate(ctypes.byref(handle)), "Create")
            _HANDLES[device] = handle
        try:
            plan = _Plan(lib, _HANDLES[device], *key[1:], workspace.numel())
            plan.pick(*operands, workspace)
            _PLANS[key] = plan
        except RuntimeError as e:
            _refuse(key, e, 4)  # _refuse, _plan, _general_gemm, TE's module
    return _PLANS[key]


def _refuse(key: tuple, err: RuntimeError, stacklevel: int) -> None:
    """TE runs ``key``'s form from now on; say once why (the warning points at TE's module,
    ``stacklevel`` frames up)."""
    _PLANS[key] = None
    what = "the residual add stays apart from the FP8 GEMM" if key[8] else "TE runs the FP8 input-gradient GEMM"
    warnings.warn(f"fp8vit: {what} (m={key[1]}, n={key[2]}, k={key[3]}): {err}", RuntimeWarning,
                  stacklevel=stacklevel)


class _Offer:
    """A block's residual stream offered to its branch's last GEMM (:func:`into_residual`)."""

    __slots__ = ("residual", "inner", "taken")

    def __init__(self, residual: torch.Tensor, inner: int):
        self.residual, self.inner, self.taken = residual, inner, False


_OFFER: contextvars.ContextVar[Optional[_Offer]] = contextvars.ContextVar("fp8vit_residual_offer", default=None)
# each module's general_gemm; while installed it is _general_gemm bound to TE's
_ROUTE = Route([(name, "general_gemm") for name in _MODULES], lambda te_gemm: functools.partial(_general_gemm, te_gemm),
               lambda: residual_gemm_support().ok)
_FP8_TYPES = {}  # tex.DType -> cuBLASLt type (filled on first use: tex imports with TE)
_TE_KWARGS = {"out_dtype", "quantization_params", "bias", "use_split_accumulator", "ub", "ub_type", "extra_output",
              "gelu", "accumulate", "layout", "out", "grad", "alpha", "beta", "gelu_in", "bulk_overlap"}
_DEFAULTS = {"quantization_params": None, "ub": None, "ub_type": None, "extra_output": None, "gelu": False,
             "accumulate": False, "out": None, "alpha": 1.0, "beta": None, "gelu_in": None, "bulk_overlap": False}


def residual_gemm_enabled() -> bool:
    """Whether TE's forward GEMMs take an offered residual now (:func:`set_residual_gemm`)."""
    return _ROUTE.enabled()


def set_residual_gemm(enable: bool = True) -> bool:
    """Let TE's ``Linear`` and ``LayerNormMLP`` forward GEMMs take a residual a block offers
    (:func:`into_residual`), or give TE its own ``general_gemm`` back.

    Args:
        enable: install the routing (True) or remove it (False).

    Returns:
        whether it is installed after the call: False where :func:`residual_gemm_support` says
        it cannot run.
    """
    return _ROUTE.set(enable)


def residual_gemm(enabled: bool) -> ContextManager[bool]:
    """:func:`set_residual_gemm` for the duration of a ``with`` block (it yields whether the routing
    is installed), then the previous setting again."""
    return _ROUTE.scope(enabled)


@contextlib.contextmanager
def into_residual(residual: torch.Tensor, inner: int) -> Iterator[_Offer]:
    """Offer ``residual`` ``[..., C]`` (bf16, contiguous) to the first forward GEMM in the block
    whose output has its shape and whose inner width is ``inner``; yields the offer, whose
    ``taken`` says whether that GEMM's output already holds ``residual`` (then join the gradients
    with :func:`residual_added`; else add it as usual)."""
    offer = _Offer(residual, inner)
    token = _OFFER.set(offer)
    try:
        yield offer
    finally:
        _OFFER.reset(token)


class _ResidualAdded(torch.autograd.Function):
    """``y``, which a GEMM computed as ``branch + x``: the gradient of ``y`` goes to ``x`` as well."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad


def residual_added(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``y`` (``x`` already added in by the GEMM that took the offer) with ``x``'s gradient path."""
    return _ResidualAdded.apply(x, y)


def _fp8_type(t: Any) -> Optional[int]:
    """cuBLASLt's type of a per-tensor FP8 TE tensor's rowwise data, None for anything else."""
    storage = te_module("transformer_engine.pytorch.tensor.storage.float8_tensor_storage").Float8TensorStorage
    if not isinstance(t, storage) or getattr(t, "_data", None) is None or getattr(t, "_scale_inv", None) is None:
        return None
    if not _FP8_TYPES:
        tex = te_module("transformer_engine_torch")
        _FP8_TYPES.update({tex.DType.kFloat8E4M3: _R_8F_E4M3, tex.DType.kFloat8E5M2: _R_8F_E5M2})
    return _FP8_TYPES.get(t._fp8_dtype)


def _operands(offer: Optional[_Offer], A: Any, B: Any, args: tuple,
              kwargs: dict) -> Optional[Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Tuple[int, int]]]:
    """``(w, x, residual, cuBLASLt types of w and x)`` where this ``general_gemm(A, B, ...)`` call
    runs here, else None: the forward GEMM ``offer`` waits for (layout TN: ``w`` is A's rowwise
    ``[m, k]``, ``residual`` the offer's), or an input-gradient GEMM (layout NN, ``dx = dy W``:
    ``w`` is the weight's FP8 transpose ``[in, out]``, ``x`` is dy ``[..., out]``, no residual)."""
    if args or not _TE_KWARGS.issuperset(kwargs):
        return None
    layout, grad, bias = kwargs.get("layout", "TN"), kwargs.get("grad", False), kwargs.get("bias")
    dgrad = layout == "NN" and grad is True and bias is None
    if not dgrad and (offer is None or offer.taken or layout != "TN" or grad is not False):
        return None
    for name, default in _DEFAULTS.items():  # TE's defaults only: no quantized output, accumulation, GELU, ...
        got = kwargs.get(name, default)
        if (got is not None) if default is None else (type(got) is not type(default) or got != default):
            return None
    if kwargs.get("out_dtype") != torch.bfloat16:
        return None
    types = _fp8_type(A), _fp8_type(B)
    if None in types:
        return None
    if dgrad:  # the weight's columnwise copy, as TE's GEMM reads it on sm89/sm90 (on GPUs with
        # non-TN FP8 GEMMs TE keeps none, and runs it itself)
        w = None if getattr(A, "_transpose_invalid", True) else getattr(A, "_transpose", None)
    else:
        w = A._data
    x = B._data
    if w is None or w.dim() != 2 or not w.is_contiguous() or not x.is_contiguous() or w.device != x.device:
        return None
    m, k = w.shape
    if x.shape[-1] != k or (bias is not None and not (bias.dtype == torch.bfloat16 and bias.shape == (m,)
                                                      and bias.is_contiguous())):
        return None
    if dgrad:
        return w, x, None, types
    r = offer.residual
    ok = (k == offer.inner and m == r.shape[-1] and x.numel() // k == r.numel() // m and x.device == r.device
          and r.dtype == torch.bfloat16 and r.is_contiguous())
    return (w, x, r, types) if ok else None


def _general_gemm(te_gemm: Any, A: Any, B: Any, *args, **kwargs):
    """TE's ``general_gemm``, by fp8vit's call where :func:`_operands` takes it: the offered
    residual in the epilogue, or an input gradient on the timed algorithm."""
    offer = _OFFER.get()
    operands = _operands(offer, A, B, args, kwargs)
    if operands is None:
        return te_gemm(A, B, *args, **kwargs)
    w, x, r, types = operands
    bias = kwargs.get("bias")
    m, k = w.shape
    workspace = te_module("transformer_engine.pytorch.cpp_extensions.gemm").get_cublas_workspace(
        x.device.index, False, False)
    aligns = (_alignment(w.data_ptr()), _alignment(x.data_ptr()), 256 if r is None else _alignment(r.data_ptr()), 256)
    fast = not kwargs.get("use_split_accumulator", False)
    key = (x.device.index, m, x.numel() // k, k, *types, fast, bias is not None, r is not None, aligns, _SEARCH[0])
    if _PLANS.get(key, True) is None:  # refused before
        return te_gemm(A, B, *args, **kwargs)
    out = torch.empty(*x.shape[:-1], m, dtype=torch.bfloat16, device=x.device)  # torch's allocations: 256-aligned
    run = (w, A._scale_inv, x, B._scale_inv, bias, r, out)
    plan = _PLANS.get(key) or _plan(key, workspace, run)
    if plan is None:
        return te_gemm(A, B, *args, **kwargs)
    try:
        plan.run(*run, workspace)
    except RuntimeError as e:  # refused before anything was enqueued
        _refuse(key, e, 3)  # _refuse, _general_gemm, TE's module
        return te_gemm(A, B, *args, **kwargs)
    if r is not None:
        offer.taken = True
    return out, None, None, None
