"""fc1's GELU backward in the epilogue of fc2's FP8 dgrad GEMM (lever 59).

TE 2.20's ``LayerNormMLP`` backward under delayed scaling runs fc2's dgrad GEMM with a bf16 output
``[T, H]`` (``T`` tokens, ``H`` hidden units), then ``tex.dbias_dgelu``, which reads it and the saved
pre-GELU ``fc1_out`` ``[T, H]`` and writes the FP8 gradient, its transpose and fc1's bias gradient:
8 bytes an element after the GEMM's 2. cuBLASLt can apply the GELU's derivative in the GEMM's
epilogue (``fc1_out`` its aux input) and write the FP8 gradient and its amax itself, which TE asks
for only without FP8. Here the GEMM does that, and one Triton pass
(:func:`fp8vit._te.kernels.fp8_transpose_dbias`) writes the transpose and sums the bias gradient
from the FP8 values, the values fc1's weight gradient is computed from: 5 bytes an element, not 10
(``docs/perf/dgelu_gemm_bench.py``; TE sums the bias gradient before the cast).

How, while installed (:func:`set_dgelu_gemm`, by :func:`fp8vit._te.bias_grad.set_bias_grad_kernel`:
one switch for fp8vit's bias-gradient kernels, on in the graphs' backward by default): TE's
``_LayerNormMLP.backward`` is wrapped. Where a call qualifies (:func:`_qualifies`: FP8 per-tensor
delayed scaling, the ``gelu`` activation, none of TE's debug, userbuffers or bias-GELU paths), the
first GEMM with ``grad=True`` inside it, which is fc2's dgrad in TE's code order, is deferred if it
has the expected form (``NN``, no epilogue, a bf16 output): it returns a placeholder that TE hands
to ``tex.dbias_dgelu`` with ``fc1_out``, and there the fused GEMM runs. Any other use of the
placeholder fails on its shape; a backward that never consumed it raises. Where cuBLASLt has no
such kernel (its algorithm query fails on the host, before anything runs), one warning, and TE's
two steps from then on. TE's modules look the
replaced functions up at each call (``general_gemm`` in ``layernorm_mlp``'s globals,
``dbias_dgelu`` on the extension module).
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List

import torch

from .._warn import warn_once
from .kernels import fp8_transpose_dbias
from .loader import te_module, te_version

__all__ = ["set_dgelu_gemm", "dgelu_gemm_enabled"]

_MLP_MODULE = "transformer_engine.pytorch.module.layernorm_mlp"
_TE_FUNCTIONS: Dict[str, Any] = {}  # TE's own functions while fp8vit's are installed
_REFUSED: List[str] = []  # cuBLASLt's refusal of the fused GEMM on this machine, once seen
_LOCAL = threading.local()  # the backward in flight on this thread (autograd runs each device's on one)
# TE 2.20's fc2 dgrad call: general_gemm(fc2_weight, grad_output, layout="NN", grad=True,
# quantization_params=None, out_dtype=..., gelu=False, gelu_in=None, use_split_accumulator=..., ub=None,
# ub_type=None): these keywords and no others (positional arguments: the two operands only).
_DGRAD_KEYWORDS = frozenset({"layout", "grad", "quantization_params", "out_dtype", "gelu", "gelu_in",
                             "use_split_accumulator", "ub", "ub_type"})


def dgelu_gemm_enabled() -> bool:
    """Whether TE's MLP backward currently runs fc1's GELU backward in fc2's dgrad GEMM."""
    return bool(_TE_FUNCTIONS)


def set_dgelu_gemm(enable: bool) -> bool:
    """Install the fusion (``enable``) or put TE's functions back; returns whether it is installed
    after the call (the caller checks that Triton runs: ``fp8vit._te.kernels.triton_support()``)."""
    if enable == dgelu_gemm_enabled():
        return enable
    mlp, tex = te_module(_MLP_MODULE), te_module("transformer_engine_torch")
    if enable:
        _TE_FUNCTIONS.update(backward=mlp._LayerNormMLP.backward, general_gemm=mlp.general_gemm,
                             dbias_dgelu=tex.dbias_dgelu)
        mlp._LayerNormMLP.backward, mlp.general_gemm, tex.dbias_dgelu = (
            staticmethod(_backward), _general_gemm, _dbias_dgelu)
    else:
        mlp._LayerNormMLP.backward = staticmethod(_TE_FUNCTIONS.pop("backward"))
        mlp.general_gemm = _TE_FUNCTIONS.pop("general_gemm")
        tex.dbias_dgelu = _TE_FUNCTIONS.pop("dbias_dgelu")
    return dgelu_gemm_enabled()


def _qualifies(ctx: Any) -> bool:
    """A ``_LayerNormMLP`` backward whose fc2 dgrad and GELU backward TE runs as described above."""
    recipe = getattr(ctx, "fp8_recipe", None)
    float8 = te_module("transformer_engine.pytorch.tensor.float8_tensor").Float8Quantizer
    return (bool(getattr(ctx, "fp8", False)) and recipe is not None and recipe.delayed()
            and getattr(ctx, "activation", None) == "gelu" and not getattr(ctx, "debug", True)
            and not getattr(ctx, "bias_gelu_fusion", True)
            and not any(getattr(ctx, flag, True) for flag in
                        ("ub_overlap_ag", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad"))
            and type(getattr(ctx, "fc1_grad_output_quantizer", None)) is float8)


def _backward(ctx, *grad_outputs):
    state = {"armed": _qualifies(ctx), "pending": None}
    outer, _LOCAL.state = getattr(_LOCAL, "state", None), state
    try:
        grads = _TE_FUNCTIONS["backward"](ctx, *grad_outputs)
    finally:
        _LOCAL.state = outer
    if state["pending"] is not None:
        raise RuntimeError("fp8vit (lever 59): TE's LayerNormMLP backward did not pass fc2's deferred dgrad "
                           "to tex.dbias_dgelu: this TE's backward differs from TE 2.20's; report it with "
                           f"TE's version ({te_version()})")
    return grads


def _general_gemm(A, B, *args, **kwargs):
    state = getattr(_LOCAL, "state", None)
    if state is not None and state["armed"] and kwargs.get("grad"):
        state["armed"] = False  # only the backward's first grad GEMM is fc2's dgrad
        if (not args and set(kwargs) <= _DGRAD_KEYWORDS and kwargs.get("layout") == "NN"
                and not kwargs.get("gelu") and kwargs.get("quantization_params") is None
                and kwargs.get("ub") is None and kwargs.get("out_dtype") in (torch.bfloat16, torch.float16)):
            placeholder = torch.empty(0, dtype=kwargs["out_dtype"])  # never read: identity only
            state["pending"] = (placeholder, A, B, kwargs)
            return placeholder, None, None, None
    return _TE_FUNCTIONS["general_gemm"](A, B, *args, **kwargs)


def _dbias_dgelu(grad, fwd_input, quantizer, *args, **kwargs):
    state = getattr(_LOCAL, "state", None)
    pending = None if state is None else state["pending"]
    if pending is None or grad is not pending[0]:
        return _TE_FUNCTIONS["dbias_dgelu"](grad, fwd_input, quantizer, *args, **kwargs)
    state["pending"] = None
    _, A, B, gemm_kwargs = pending
    if not (args or kwargs or _REFUSED) and _takes(fwd_input, quantizer):
        try:
            return _fused(A, B, gemm_kwargs, fwd_input, quantizer)
        except RuntimeError as err:  # cuBLASLt without this epilogue for FP8: found on the host, nothing ran
            if "cublas" not in str(err).lower():
                raise
            _REFUSED.append(str(err))
            warn_once(f"fp8vit: cuBLASLt refuses fc1's GELU backward in fc2's FP8 dgrad GEMM here "
                      f"({str(err).strip()[:200]}); TE's own kernels run it (docs/performance.md, lever 59)")
    # not the call this was written for: TE's two steps, as without fp8vit
    out = _TE_FUNCTIONS["general_gemm"](A, B, **gemm_kwargs)[0]
    return _TE_FUNCTIONS["dbias_dgelu"](out, fwd_input, quantizer, *args, **kwargs)


def _takes(fwd_input: torch.Tensor, quantizer: Any) -> bool:
    """The fused call applies: a contiguous CUDA pre-GELU input of at least two dimensions, a
    quantizer that wants the FP8 bytes and their transpose (as TE's ``dbias_dgelu`` makes them)."""
    return (fwd_input.is_cuda and fwd_input.is_contiguous() and fwd_input.dim() >= 2
            and bool(quantizer.rowwise_usage and quantizer.columnwise_usage))


def _fused(A, B, gemm_kwargs: dict, fwd_input: torch.Tensor, quantizer: Any):
    """``[bias gradient, FP8 gradient]`` as ``tex.dbias_dgelu`` returns them: the GEMM writes the
    FP8 bytes (GELU's derivative in its epilogue, ``fwd_input`` [..., H] its aux input) and their
    amax; one Triton pass the transpose and the bias gradient."""
    tex = te_module("transformer_engine_torch")
    H = fwd_input.shape[-1]
    # TE makes the output from the quantizer (the bytes and, with its columnwise usage, room for
    # the transpose) and hands cuBLASLt its scale and amax
    out = _TE_FUNCTIONS["general_gemm"](A, B, **dict(gemm_kwargs, gelu=True, gelu_in=fwd_input,
                                                     quantization_params=quantizer))[0]
    # 1 / scale as TE's casts write it; the bias gradient scaled by the same tensor
    torch.reciprocal(quantizer.scale, out=out._scale_inv)
    dbias = fp8_transpose_dbias(out._data.view(-1, H), out._transpose.view(H, -1), out._scale_inv,
                                quantizer.dtype == tex.DType.kFloat8E5M2, fwd_input.dtype)
    out._transpose_invalid = False
    return [dbias, out]
