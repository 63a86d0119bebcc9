"""The seam: the only package that touches ``transformer_engine`` (its internals included) and Triton.

The layers above import from here, never from TE or Triton themselves (``lint-imports`` holds it,
see ``pyproject.toml``). One concern per module:

==================  ==================================================================================
``loader``          importing TE: whether it imports, why not (not installed, too old, no CUDA, the
                    cuDNN clash), its version, TE's own capability checks, its submodules
``recipes``         FP8 recipe names <-> TE recipe objects, and the token-row multiple each needs
``fp8``             TE's autocast, the active recipe, FP8 primary weights and their optimizer,
                    FP8-aware activation checkpointing, delayed-scaling state (read and repaired)
``extra_state``     FP8 scaling state checkpointed as plain tensors (never a pickle); modules that
                    pickle whole
``recipe_switch``   delayed scaling that keeps updating after a switch of recipe kind (a TE 2.20 gap)
``module_types``    the TE modules the blocks are built from, and the FP8 ``Linear`` swapped in for a
                    model's ``nn.Linear``
``ops``             kernels called one by one: packed-QKV attention, fused RoPE, gated activations,
                    cuDNN LayerNorm
``param_cast``      a block's norm weights and biases cast to the autocast dtype in one kernel
``graphs``          CUDA-graph capture and weight gradients written into fp32 ``main_grad`` buffers
``graph_forward``   TE's graphed forward without its per-call walk over the module tree
``kernels``         fp8vit's own Triton kernels
``bias_grad``       TE's FP8 bias gradients (cast, transpose, column sums) on one of those kernels
``norm_grad``       the residual stream's gradient added in TE's LayerNorm backward, on another
``gemm_residual``   fp8vit's own cuBLASLt calls for TE's FP8 GEMMs: a block's residual add in the
                    GEMM before it, the input gradients, each on its fastest algorithm
``route``           TE functions replaced process-wide (the three above) and given back, and the
                    scoped on/off switch they and cuDNN LayerNorm share
==================  ==================================================================================

``import fp8vit`` imports TE here (:func:`preload`) when it is installed and a GPU is visible: TE
must be imported before torch runs its first cuDNN kernel.
"""

from .extra_state import EXTRA_STATE_FORMAT
from .fp8 import (active_fp8_recipe, autocast, checkpoint, fused_adam, is_quantized, quantized_model_init,
                  repair_amax_histories, scaling_state)
from .bias_grad import bias_grad_kernel, bias_grad_kernel_enabled, set_bias_grad_kernel
from .graph_forward import lean_graphed_forward
from .norm_grad import Slot, fork, join, norm_grad_add, norm_grad_add_enabled, set_norm_grad_add
from .graphs import make_graphed_callables, release_main_grad, restore_scaling, save_scaling, wgrad_into_main_grad
from .loader import (INSTALL_HINT, MIN_TE_VERSION, clear_cache, installed, load_te, preload, release_import_warnings,
                     te_check, te_module, te_status, te_version)
from .module_types import MODULE_NAMES, SwappedLinear, fp8_linear_class, modules, transformer_layer_class
from .param_cast import cast_small_params
from .gemm_residual import (into_residual, residual_added, residual_gemm, residual_gemm_enabled, residual_gemm_support,
                            set_algorithm_search, set_residual_gemm)
from .ops import attention_backend, cudnn_norm, cudnn_norm_available, cudnn_norm_enabled, fused_rope, gated_activation, packed_attention, set_cudnn_norm

__all__ = [
    # importing TE
    "te_status", "te_version", "installed", "load_te", "preload", "release_import_warnings", "clear_cache", "te_check", "te_module",
    "MIN_TE_VERSION", "INSTALL_HINT",
    # FP8 execution state
    "autocast", "active_fp8_recipe", "quantized_model_init", "is_quantized", "fused_adam", "checkpoint",
    "scaling_state", "repair_amax_histories", "EXTRA_STATE_FORMAT",
    # modules and kernels
    "modules", "MODULE_NAMES", "SwappedLinear", "fp8_linear_class", "transformer_layer_class",
    "packed_attention", "attention_backend", "fused_rope", "gated_activation", "cudnn_norm", "cudnn_norm_available", "cudnn_norm_enabled", "set_cudnn_norm",
    "cast_small_params", "set_bias_grad_kernel", "bias_grad_kernel_enabled", "bias_grad_kernel",
    "set_residual_gemm", "residual_gemm", "residual_gemm_enabled", "residual_gemm_support", "into_residual",
    "residual_added", "set_algorithm_search", "set_norm_grad_add", "norm_grad_add", "norm_grad_add_enabled",
    "Slot", "fork", "join",
    # CUDA graphs
    "make_graphed_callables", "lean_graphed_forward", "wgrad_into_main_grad", "release_main_grad", "save_scaling",
    "restore_scaling",
]


def __getattr__(name: str):
    """``fp8vit._te.LayerNormLinear``, ``fp8vit._te.FP8Linear`` etc.: TE's classes with fp8vit's
    mixins, made on first use. Whole-model pickles name them here."""
    if name in MODULE_NAMES:
        return getattr(modules(), name)
    if name == "FP8Linear":
        return fp8_linear_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
