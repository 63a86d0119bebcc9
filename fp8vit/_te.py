"""The only module that touches ``transformer_engine``, its internals included.

Everything TE-specific that the rest of fp8vit needs goes through here:

* import with an explanation of *why* it failed (not installed, no CUDA, the cuDNN clash),
  cached as a :class:`Check`;
* the oldest TE it accepts (:data:`MIN_TE_VERSION`, checked with ``packaging`` before importing);
* the TE modules fp8vit builds blocks from, subclassed so that their FP8 scaling state is
  checkpointed as plain tensors instead of a pickle (see ``_SafeExtraState``);
* the FP8 ``Linear`` swapped in for a model's ``nn.Linear`` (:class:`SwappedLinear`);
* readers and writers of TE's delayed-scaling state (``fp8_meta``) for diagnostics and guards;
* CUDA-graph capture (``make_graphed_callables``) and the plain ``TransformerLayer`` (bench only);
* FP8 primary weights (``quantized_model_init``) and the optimizer TE pairs with them (``FusedAdam``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import math
import os
import types
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
from packaging.version import Version
from torch import nn

from ._warn import warn_once
from .errors import Check, TEUnavailableError

__all__ = [
    "te_status", "te_version", "installed", "load_te", "preload", "release_import_warnings", "clear_cache", "te_check",
    "recipe_module", "autocast", "quantized_model_init", "is_quantized", "fused_adam", "set_cudnn_norm", "cudnn_norm", "cudnn_norm_enabled", "checkpoint", "active_fp8_recipe", "packed_attention", "fused_rope", "modules", "MODULE_NAMES",
    "SwappedLinear", "fp8_linear_class",
    "scaling_state", "repair_amax_histories", "make_graphed_callables", "wgrad_into_main_grad", "release_main_grad",
    "transformer_layer_class", "EXTRA_STATE_FORMAT", "MIN_TE_VERSION",
]

# The oldest TE fp8vit runs on: the version it is measured with, and the first that refuses to
# unpickle a checkpoint's FP8 state unless NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1 is set.
MIN_TE_VERSION = "2.20"

# fp8vit is not on PyPI, so "pip install 'fp8vit[te]'" would fail: TE's own package name works
# everywhere, and the extra from a clone is the same requirement.
INSTALL_HINT = (f"install it with: pip install \"transformer-engine[pytorch]>={MIN_TE_VERSION}\"  "
                "(or, in a clone of fp8vit: pip install '.[te]')")

# Format tag of the plain-tensor FP8 scaling state written by fp8vit (see _SafeExtraState).
EXTRA_STATE_FORMAT = "fp8vit.delayed_scaling.v1"


def _explain_import_error(err: BaseException) -> str:
    """Turn an exception raised by ``import transformer_engine.pytorch`` into a reason."""
    msg = f"{type(err).__name__}: {err}"
    if isinstance(err, ModuleNotFoundError) and (err.name or "").split(".")[0] == "transformer_engine":
        return f"Transformer Engine is not installed; {INSTALL_HINT}"
    low = msg.lower()
    if "undefined symbol" in low and "cudnn" in low:
        cudnn_dir = _torch_cudnn_dir()
        return (
            "Transformer Engine loaded a different cuDNN than torch and failed with "
            f"'{msg}'. This happens when torch ran a cuDNN kernel (a conv, e.g. a ViT patch "
            "embedding) before TE was first imported. Fix: `import fp8vit` (which imports TE) "
            "before running any model, or point CUDNN_PATH and LD_LIBRARY_PATH at torch's cuDNN"
            + (f" ({cudnn_dir})" if cudnn_dir else "")
            + "."
        )
    if "libcuda" in low or "cuda driver" in low or "no cuda gpus" in low or "nvidia driver" in low:
        return f"Transformer Engine needs a CUDA driver and GPU, and failed with '{msg}'"
    return f"importing transformer_engine.pytorch failed with '{msg}'; {INSTALL_HINT}"


def _torch_cudnn_dir() -> Optional[str]:
    """The folder holding the cuDNN that torch uses (pip wheels: nvidia/cudnn/lib), if any."""
    spec = importlib.util.find_spec("nvidia")
    for root in list(spec.submodule_search_locations or []) if spec else []:
        for sub in ("cudnn/lib", "cu13/lib"):
            path = os.path.join(root, sub)
            if os.path.isdir(path) and any(f.startswith("libcudnn") for f in os.listdir(path)):
                return path
    return None


@functools.lru_cache(maxsize=None)
def _import() -> Tuple[Optional[types.ModuleType], str]:
    ver = te_version()
    if ver is not None and Version(ver) < Version(MIN_TE_VERSION):
        return None, (f"Transformer Engine {ver} is older than {MIN_TE_VERSION}, the oldest fp8vit supports "
                      "(older TE runs the pickle stored in a checkpoint's FP8 state when loading it); "
                      f"upgrade: pip install -U 'transformer-engine[pytorch]>={MIN_TE_VERSION}'")
    try:
        te = importlib.import_module("transformer_engine.pytorch")
    except Exception as err:  # noqa: BLE001 - every failure becomes a reason
        return None, _explain_import_error(err)
    return te, ""


# Warnings TE raised while ``import fp8vit`` imported it (preload), not yet issued: TE's notes about
# other frameworks (a Jax installation without TE's Jax extension) would otherwise print before a
# tool's first line. They are issued, with TE's file and line, at the first te_status() or load_te().
_held_import_warnings: List[warnings.WarningMessage] = []


def release_import_warnings() -> None:
    """Issue the warnings held from TE's import at ``import fp8vit`` (once; nothing if none)."""
    held = list(_held_import_warnings)
    _held_import_warnings.clear()
    for w in held:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def te_status() -> Check:
    """Whether Transformer Engine imports here. Cached (see :func:`clear_cache`).

    Returns:
        ``Check(ok, reason)``: ``reason`` is empty when ``ok``, else says why and how to fix it.
    """
    release_import_warnings()
    te, reason = _import()
    return Check(te is not None, reason)


def te_version() -> Optional[str]:
    """The installed Transformer Engine's version (from its distribution metadata), or None."""
    for dist in ("transformer_engine", "transformer-engine", "transformer_engine_torch"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def installed() -> bool:
    """Whether a ``transformer_engine`` package is installed (importable or not)."""
    return importlib.util.find_spec("transformer_engine") is not None


def clear_cache() -> None:
    """Forget the cached import result and capability answers (a failed import is retried)."""
    _import.cache_clear()
    te_check.cache_clear()


def load_te() -> types.ModuleType:
    """Return ``transformer_engine.pytorch`` or raise :class:`TEUnavailableError` with the reason."""
    release_import_warnings()
    te, reason = _import()
    if te is None:
        raise TEUnavailableError(reason)
    return te


def preload() -> None:
    """Import TE now if it is installed and a GPU is visible.

    TE must be imported before torch runs its first cuDNN kernel (see ``_explain_import_error``),
    so ``import fp8vit`` does it eagerly. Set ``FP8VIT_LAZY_TE=1`` to skip it. The warnings TE
    raises while it is imported (under the filters in force) are held and issued at the first
    :func:`te_status` or :func:`load_te`, where a tool can collect them (:func:`release_import_warnings`).
    """
    if os.environ.get("FP8VIT_LAZY_TE") == "1":
        return
    if not installed() or not torch.cuda.is_available():
        return
    with warnings.catch_warnings(record=True) as caught:  # the filters in force still apply
        _import()
    _held_import_warnings.extend(caught)


def autocast(enabled: bool, recipe: Any, amax_reduction_group=None):
    """TE's FP8 autocast (``te.autocast``; ``te.fp8_autocast`` is its deprecated name).

    Args:
        amax_reduction_group: the process group over which delayed scaling's amaxes are
            max-reduced when the autocast (forward) and the first module's backward end. None:
            TE reduces over the default group whenever ``torch.distributed`` is initialized
            (TE 2.20 ``quantization.py``, ``reduce_and_update_fp8_tensors``: it asks
            ``get_world_size(group=None)``).
    """
    return load_te().autocast(enabled=enabled, recipe=recipe, amax_reduction_group=amax_reduction_group)


def quantized_model_init(recipe: Any):
    """``te.quantized_model_init(enabled=True, recipe=recipe)``: TE modules built inside hold only
    quantized (FP8) copies of their GEMM weights, as ``QuantizedTensor`` parameters."""
    return load_te().quantized_model_init(enabled=True, recipe=recipe)


def is_quantized(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (or, for an FSDP2 ``DTensor``, its local shard) is a TE ``QuantizedTensor``
    (an FP8 primary weight). False where TE is absent."""
    if _import()[0] is None:
        return False
    local = getattr(tensor, "_local_tensor", tensor)
    return isinstance(local, load_te().QuantizedTensor)


def fused_adam(params, **kwargs):
    """``te.optimizers.FusedAdam(params, **kwargs)``: the optimizer TE pairs with FP8 primary
    weights (``master_weights=True`` keeps an fp32 master copy of each one in its state)."""
    return load_te().optimizers.FusedAdam(params, **kwargs)


def checkpoint(function, *args, **kwargs):
    """Activation checkpointing that keeps TE's FP8 state consistent on recompute."""
    return load_te().checkpoint(function, *args, use_reentrant=False, **kwargs)


def recipe_module() -> types.ModuleType:
    """``transformer_engine.common.recipe`` (recipe classes and ``Format``)."""
    load_te()
    return importlib.import_module("transformer_engine.common.recipe")


@functools.lru_cache(maxsize=None)
def _state_manager():
    load_te()
    return importlib.import_module("transformer_engine.pytorch.quantization").FP8GlobalStateManager


def active_fp8_recipe() -> Optional[Any]:
    """The recipe of the innermost enabled TE FP8 autocast, or None (also when TE is absent)."""
    if _import()[0] is None:
        return None
    mgr = _state_manager()
    return mgr.get_fp8_recipe() if mgr.is_fp8_enabled() else None


def packed_attention(attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """``DotProductAttention`` on q, k, v that are views of one packed buffer (layout ``bs3hd``).

    TE finds the packed layout from the views' pointers and strides and warns that this is
    deprecated in favour of ``qkv_layer=``. But ``qkv_layer=`` slices the buffer inside TE with
    ``select``, whose autograd backward zero-fills and copies the whole packed gradient once per
    view (docs/performance.md); fp8vit splits the buffer itself so that the gradient comes back
    packed. Should a later TE drop the detection, q, k, v are still valid separate inputs.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Relying on pointer-based detection", category=DeprecationWarning)
        return attn(query_layer=q, key_layer=k, value_layer=v, **kwargs)



def fused_rope(t: torch.Tensor, angles: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """TE's fused RoPE kernel on ``t`` ``[B, N, H, D]`` (``bshd``, any strides: a view of a packed
    QKV buffer is read in place), ``angles`` ``[N, 1, 1, D]`` fp32, one angle per channel.

    ``out = t * cos(angles) + rot(t) * sin(angles)`` with ``rot`` pairing channels ``(2i, 2i+1)``
    (``interleaved``) or ``(i, i + D/2)``; forward and backward are one kernel each.
    """
    rope = _rope_module()
    return rope.apply_rotary_pos_emb(t, angles, tensor_format="bshd", interleaved=interleaved, fused=True)


class _GatedActivation(torch.autograd.Function):
    """TE's gated activation kernel and its backward, for the unfused MLP (:func:`gated_activation`)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, name: str) -> torch.Tensor:
        tex = _tex()
        ctx.name = name
        ctx.save_for_backward(h)  # [..., 2H]: less than torch keeps (gate, act(gate), value)
        return getattr(tex, name)(h, None)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (h,) = ctx.saved_tensors
        return getattr(_tex(), "d" + ctx.name)(dy.contiguous(), h, None), None


def gated_activation(name: str):
    """``h [..., 2H] -> act(h[..., :H]) * h[..., H:]`` in one TE kernel (``swiglu``, ``geglu``,
    ``reglu``, ``qgeglu``, ``glu``), the backward in one more.

    Torch runs ``act(gate) * value`` on the two halves, views with a row stride of 2H that its
    vectorized kernels do not take: three strided kernels forward and backward, a third of EVA02-B's
    step time outside the GEMMs (docs/performance.md, lever 18).
    """
    # A partial of a module-level function, not a closure: the unfused MLP keeps it as an attribute
    # (``UnfusedMlp.gated_act``), and a closure made ``torch.save(model)`` / pickling fail.
    return functools.partial(_apply_gated_activation, name=name)


def _apply_gated_activation(h: torch.Tensor, name: str) -> torch.Tensor:
    return _GatedActivation.apply(h.contiguous(), name)


@functools.lru_cache(maxsize=None)
def _tex() -> types.ModuleType:
    load_te()
    return importlib.import_module("transformer_engine_torch")


@functools.lru_cache(maxsize=None)
def _rope_module() -> types.ModuleType:
    load_te()
    return importlib.import_module("transformer_engine.pytorch.attention.rope")


@functools.lru_cache(maxsize=None)
def te_check(fn_name: str) -> Check:
    """Ask TE one of its capability questions (``is_fp8_available``, ...). Cached; needs TE.

    Returns:
        TE's answer and reason, or a Check saying this TE lacks the function.
    """
    fn = getattr(load_te(), fn_name, None)
    if fn is None:
        return Check(False, f"this Transformer Engine has no {fn_name}()")
    ok, reason = fn(return_reason=True)
    return Check(bool(ok), reason or "")



# --------------------------------------------------------------------------- checkpoint state
class _SafeExtraState:
    """Mixin for TE modules: FP8 delayed-scaling state as plain tensors, never a pickle; and
    modules that pickle whole (``torch.save(model)``).

    TE stores the delayed-scaling scales and amax histories in ``_extra_state`` as a pickled
    byte tensor, and since 2.20 refuses to load it without ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1``
    (a pickle can run arbitrary code). Here the same state is a dict of tensors, ints, floats,
    bools and strings, which ``torch.load(weights_only=True)`` reads safely. Stateless recipes
    (current, block, mxfp8) and modules that never ran FP8 store TE's empty tensor as before.
    Old TE pickles still go through TE's own (guarded) loader.
    """

    def get_extra_state(self):
        meta = self.fp8_meta
        recipe = meta.get("recipe")
        ran_fp8 = meta.get("fp8_checkpoint") or self.fp8 or self.fp8_calibration
        if not ran_fp8 or recipe is None or not recipe.delayed() or "scaling_fwd" not in meta:
            return torch.empty(0, dtype=torch.uint8)
        if callable(recipe.amax_compute_algo) or recipe.scaling_factor_compute_algo is not None:
            raise ValueError(
                f"cannot checkpoint DelayedScaling with a custom callable ({recipe}); "
                "fp8vit stores scaling state without pickles: use amax_compute_algo='max' or "
                "'most_recent' and no scaling_factor_compute_algo"
            )
        extra = {
            k: v for k, v in meta.items()
            if k != "buffer_index_and_autocast_key" and isinstance(v, (bool, int, float, str))
        }
        return {
            "format": EXTRA_STATE_FORMAT,
            "recipe": {
                "margin": int(recipe.margin),
                "fp8_format": recipe.fp8_format.name,
                "amax_history_len": int(recipe.amax_history_len),
                "amax_compute_algo": recipe.amax_compute_algo,
                "reduce_amax": bool(recipe.reduce_amax),
                "fp8_dpa": bool(recipe.fp8_dpa),
                "fp8_mha": bool(recipe.fp8_mha),
            },
            "scale_fwd": meta["scaling_fwd"].scale.detach().cpu().clone(),
            "amax_history_fwd": meta["scaling_fwd"].amax_history.detach().cpu().clone(),
            "scale_bwd": meta["scaling_bwd"].scale.detach().cpu().clone(),
            "amax_history_bwd": meta["scaling_bwd"].amax_history.detach().cpu().clone(),
            "extra_fp8_variables": extra,
        }

    def set_extra_state(self, state):
        if not (isinstance(state, dict) and state.get("format") == EXTRA_STATE_FORMAT):
            return super().set_extra_state(state)
        rec = recipe_module()
        r = dict(state["recipe"])
        r["fp8_format"] = getattr(rec.Format, r["fp8_format"])
        recipe = rec.DelayedScaling(**r)
        # .get: a distributed checkpoint (DCP) stores no entry for an empty dict
        self.fp8_meta.update(state.get("extra_fp8_variables", {}))
        self.fp8_meta["recipe"] = recipe
        self.init_fp8_meta_tensors(recipe)
        with torch.no_grad():
            for key, which in (("fwd", "scaling_fwd"), ("bwd", "scaling_bwd")):
                dst = self.fp8_meta[which]
                for name in ("scale", "amax_history"):
                    src = state[f"{name}_{key}"]
                    tgt = getattr(dst, name)
                    if src.shape != tgt.shape:
                        raise ValueError(
                            f"{type(self).__name__}: checkpoint {name}_{key} has shape "
                            f"{tuple(src.shape)}, this module expects {tuple(tgt.shape)}"
                        )
                    tgt.copy_(src)
        return None


    # ----------------------------------------------------------------- whole-module pickling
    # Pickle refuses closures. TE's attention modules register one as a load_state_dict post-hook
    # (it drops old TE versions' "core_attention._extra_state" from the missing keys): replaced by
    # the same function at module level. TE keeps each parameter's init function (a closure) in
    # param_init_meta, only for reset_parameters(): a pickled module keeps its fp8_meta_index and an
    # init function that says it is gone.
    # UnfusedDotProductAttention keeps its mask function as a closure too: same treatment.
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for mod in self.modules():
            hooks = mod._load_state_dict_post_hooks
            for key, hook in list(hooks.items()):
                if _is_local(hook, "remove_extra_states_check"):
                    hooks[key] = _drop_old_attention_extra_state
            for owner in (mod, getattr(mod, "scale_mask_softmax", None)):
                if _is_local(getattr(owner, "mask_func", None), "mask_func"):
                    owner.mask_func = _attention_mask_func

    def __getstate__(self):
        state = super().__getstate__()
        inits = state.get("param_init_meta")
        if isinstance(inits, dict):
            state = dict(state, param_init_meta={n: m.fp8_meta_index for n, m in inits.items()})
        return state

    def __setstate__(self, state):
        inits = state.get("param_init_meta")
        if isinstance(inits, dict) and all(v is None or isinstance(v, int) for v in inits.values()):
            meta_cls = _common_module()._ParameterInitMeta
            state = dict(state, param_init_meta={
                n: meta_cls(init_fn=_UnpickledInit(type(self).__name__, n), fp8_meta_index=i)
                for n, i in inits.items()})
        super().__setstate__(state)


def _is_local(fn, name: str) -> bool:
    return getattr(fn, "__qualname__", "").endswith(f"<locals>.{name}")


def _attention_mask_func(x, y):
    """TE's ``UnfusedDotProductAttention.mask_func``, picklable (same names, same module)."""
    b = importlib.import_module("transformer_engine.pytorch.attention.dot_product_attention.backends")
    return b.export.onnx_attention_mask_func(x, y) if b.is_in_onnx_export_mode() else b.attention_mask_func(x, y)


def _drop_old_attention_extra_state(module, incompatible_keys) -> None:
    """TE's ``remove_extra_states_check`` load hook, picklable: TE < 1.8 checkpoints have no
    ``core_attention._extra_state``, which is not an error."""
    for key in list(incompatible_keys.missing_keys):
        if "core_attention._extra_state" in key:
            incompatible_keys.missing_keys.remove(key)


class _UnpickledInit:
    """Init function of a TE parameter after whole-module unpickling (TE's was a closure)."""

    def __init__(self, module: str, param: str):
        self.module, self.param = module, param

    def __call__(self, tensor):
        raise ValueError(f"{self.module}.{self.param}: this module was unpickled, and TE's parameter "
                         "init function does not survive pickling; re-initialise with "
                         "TE_Block.init_weights() or build a new module")


def _common_module():
    load_te()
    return importlib.import_module("transformer_engine.pytorch.module._common")


MODULE_NAMES = ("LayerNormLinear", "Linear", "LayerNormMLP", "DotProductAttention")


@functools.lru_cache(maxsize=None)
def modules() -> types.SimpleNamespace:
    """TE's block modules with :class:`_SafeExtraState` mixed in."""
    te = load_te()

    def safe(name: str) -> type:
        # Module-level name and qualname: pickle finds the class again through __getattr__ below.
        return type(name, (_SafeExtraState, getattr(te, name)), {"__module__": __name__, "__qualname__": name})

    return types.SimpleNamespace(
        **{name: safe(name) for name in MODULE_NAMES}, gated_activation=gated_activation,
    )


# --------------------------------------------------------------------------- generic FP8 Linear
class _OwnOutput(torch.autograd.Function):
    """Identity whose output is not a view in autograd's eyes (``detach`` shares the memory), so it
    may be modified in place; the gradient passes through. Safe because TE's Linear does not keep
    its output for backward."""

    @staticmethod
    def forward(ctx, out):
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad


class SwappedLinear:
    """Mixin of :func:`fp8_linear_class`: TE's ``Linear`` standing in for a model's ``nn.Linear``
    (``convert_to_te(fallback="linear")``), where nothing around it knows about TE.

    * ``forward`` takes any leading dims, and under FP8 pads the rows (the product of the leading
      dims) with zeros to the recipe's multiple, then slices them off the output: TE's FP8 GEMMs
      need it, and the weight-gradient GEMM reduces over the rows, so padded rows change nothing.
    * ``fp8_enabled = False`` runs it in the autocast dtype inside ``fp8_context``; so does a recipe
      whose multiple the features are not (MXFP8 needs 32; fp8vit swaps multiples of 16), with one
      warning.
    * its state dict is ``nn.Linear``'s (``weight``, ``bias``), so a timm checkpoint loads as is:
      ``_extra_state`` is saved only when it holds delayed-scaling state, and may be absent on load.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fp8_enabled = True
        self.restore_owner = {}  # owner settings fp8vit.linear.switch_owner changed, for convert_from_te

    def forward(self, inp: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        # TE returns a view made inside its autograd Function, which autograd refuses to modify in
        # place; timm code around an nn.Linear may (BEiT: qkv += bias). _OwnOutput hands it out as
        # a tensor of its own, without a copy.
        return _OwnOutput.apply(self._forward(inp, *args, **kwargs))

    def _forward(self, inp: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        recipe = active_fp8_recipe()
        if recipe is None:  # outside fp8_context: TE's Linear in the autocast dtype
            return super().forward(inp, *args, **kwargs)
        mult = _row_multiple(recipe)
        if not self.fp8_enabled or self.in_features % mult or self.out_features % mult:
            if self.fp8_enabled:
                warn_once(f"fp8vit: a swapped Linear ({self.in_features} -> {self.out_features} features) runs "
                          f"in bf16: this FP8 recipe needs features that are multiples of {mult}", RuntimeWarning)
            with autocast(enabled=False, recipe=None):
                return super().forward(inp, *args, **kwargs)
        rows = math.prod(inp.shape[:-1])
        pad = -rows % mult
        if pad == 0:
            return super().forward(inp, *args, **kwargs)
        out = super().forward(torch.nn.functional.pad(inp.reshape(rows, inp.shape[-1]), (0, 0, 0, pad)),
                              *args, **kwargs)
        return out[:rows].view(*inp.shape[:-1], out.shape[-1])

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        key = prefix + "_extra_state"
        state = destination.get(key)
        if isinstance(state, torch.Tensor) and state.numel() == 0:  # no FP8 scaling state
            del destination[key]

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        key = prefix + "_extra_state"
        if key in missing_keys:  # an nn.Linear checkpoint, or a stateless recipe's
            missing_keys.remove(key)


def _row_multiple(recipe: Any) -> int:
    # recipes imports this module, so it is imported here, when a forward first needs it.
    from .recipes import recipe_name, row_multiple

    return row_multiple(recipe_name(recipe))


@functools.lru_cache(maxsize=None)
def fp8_linear_class() -> type:
    """``FP8Linear``: TE's ``Linear`` with :class:`SwappedLinear` and :class:`_SafeExtraState`
    mixed in. Build it with ``device="meta"`` and assign the ``nn.Linear``'s parameters."""
    te = load_te()
    return type("FP8Linear", (SwappedLinear, _SafeExtraState, te.Linear),
                {"__module__": __name__, "__qualname__": "FP8Linear"})


def __getattr__(name: str):
    """``fp8vit._te.LayerNormLinear`` etc., built on first use (so whole-model pickles load)."""
    if name in MODULE_NAMES:
        return getattr(modules(), name)
    if name == "FP8Linear":
        return fp8_linear_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------- kernel choice

# TE's core library reads NVTE_NORM_{FWD,BWD}_USE_CUDNN once and nvte_enable_cudnn_norm_* changes
# it afterwards; TE's torch extension reads the variable on every call to pick the current-scaling
# path (TE's fused norm + amax kernel, which cuDNN cannot replace). Both must agree, and TE has no
# getter, so the setting is kept here.
_CUDNN_NORM_VARS = ("NVTE_NORM_FWD_USE_CUDNN", "NVTE_NORM_BWD_USE_CUDNN")
_cudnn_norm = {"on": all(os.environ.get(v, "0") == "1" for v in _CUDNN_NORM_VARS)}


def cudnn_norm_enabled() -> bool:
    """Whether TE's LayerNorm runs on cuDNN's kernels (see :func:`set_cudnn_norm`)."""
    return _cudnn_norm["on"]


def set_cudnn_norm(enabled: bool) -> bool:
    """Run TE's LayerNorm forward and backward on cuDNN's kernels (process-wide). Returns the old setting."""
    load_te()
    lib = getattr(importlib.import_module("transformer_engine.common"), "_TE_LIB_CTYPES", None)
    try:
        switches = (lib.nvte_enable_cudnn_norm_fwd, lib.nvte_enable_cudnn_norm_bwd)
    except AttributeError:
        raise TEUnavailableError(
            f"Transformer Engine {te_version()} does not expose nvte_enable_cudnn_norm_fwd/bwd in its "
            "core library; upgrade TE, or leave fp8vit.set_cudnn_layernorm off") from None
    for switch, var in zip(switches, _CUDNN_NORM_VARS):
        switch(bool(enabled))
        os.environ[var] = "1" if enabled else "0"
    old, _cudnn_norm["on"] = _cudnn_norm["on"], bool(enabled)
    return old


@contextlib.contextmanager
def cudnn_norm(enabled: bool):
    """:func:`set_cudnn_norm` for the duration of the block, then the previous setting again."""
    old = set_cudnn_norm(enabled)
    try:
        yield
    finally:
        set_cudnn_norm(old)


# --------------------------------------------------------------------------- FP8 scaling state
def _delayed_states(module: nn.Module):
    """``(name, key, state)`` for every delayed-scaling state (``fp8_meta[scaling_fwd/bwd]``)."""
    for name, mod in module.named_modules():
        meta = getattr(mod, "fp8_meta", None)
        if not isinstance(meta, dict):
            continue
        for key in ("scaling_fwd", "scaling_bwd"):
            state = meta.get(key)
            if isinstance(getattr(state, "amax_history", None), torch.Tensor):
                yield name, key, state


def scaling_state(module: nn.Module) -> Dict[str, List[float]]:
    """``{submodule: [amax, scale]}`` of the forward input of every TE module under ``module``
    that ran delayed scaling (empty for stateless recipes and the reference backend)."""
    return {name: [float(st.amax_history[0][0]), float(st.scale[0])]
            for name, key, st in _delayed_states(module) if key == "scaling_fwd"}


def repair_amax_histories(module: nn.Module) -> int:
    """Replace non-finite values in every TE amax history under ``module`` by zero.

    One non-finite step would otherwise freeze the FP8 scales for the whole history length.

    Returns:
        how many histories held a non-finite value.
    """
    fixed = 0
    with torch.no_grad():
        for _, _, state in _delayed_states(module):
            hist = state.amax_history
            if not bool(torch.isfinite(hist).all()):
                torch.nan_to_num_(hist, nan=0.0, posinf=0.0, neginf=0.0)
                fixed += 1
    return fixed


# --------------------------------------------------------------------------- CUDA graphs, bench
def make_graphed_callables(modules, sample_args, *, fp8: bool, recipe: Any, num_warmup_iters: int,
                           amax_reduction_group=None, sample_kwargs=None) -> bool:
    """``te.make_graphed_callables``: forward and backward of each module captured as CUDA graphs.

    FP8 scaling factors are read from device memory inside the graphs and updated outside them
    (TE's amax reduction at the end of each autocast/backward), so delayed scaling keeps working.

    Args:
        modules: one module, or a tuple of modules called one after the other (captured in that
            order: all forwards, then the backwards in reverse, sharing one memory pool).
        sample_args: ``(tensor, ...)`` for one module, or one such tuple per module.
        sample_kwargs: None, or one dict of tensor keyword inputs per module.

    TE installs each graphed forward on its module (``module.forward``).

    Returns:
        True where TE can return parameter gradients as views of the backward graph's static
        buffers instead of copies (``clone_param_grads_on_return=False``), which it is then told
        to do: the caller must copy a ``.grad`` that still points into them before the next replay
        (forward or backward), which may rewrite them. False: TE copies them (older TE).
    """
    te = load_te()
    kwargs = {}
    grads_alias = "clone_param_grads_on_return" in inspect.signature(te.make_graphed_callables).parameters
    if grads_alias:
        kwargs["clone_param_grads_on_return"] = False
    if sample_kwargs is not None:
        kwargs["sample_kwargs"] = sample_kwargs
    if isinstance(modules, tuple) and len(modules) == 1 and sample_kwargs is None:
        modules, sample_args = modules[0], sample_args[0]
    te.make_graphed_callables(
        modules, sample_args, num_warmup_iters=num_warmup_iters, enabled=fp8,
        recipe=recipe if fp8 else None, amax_reduction_group=amax_reduction_group,
        cache_quantized_params=False, **kwargs)
    return grads_alias


def _gemm_weights(module: nn.Module) -> List[nn.Parameter]:
    """The weights whose gradient a TE GEMM module's wgrad GEMM computes, where TE passes each one
    to its GEMM as is ([] for other modules).

    A ``Linear``/``LayerNormLinear`` with split parameters (``parameters_split``, e.g. the QKV of
    ``te.TransformerLayer``) concatenates them into a new tensor first, which has no ``main_grad``:
    left alone.
    """
    if not hasattr(module, "fuse_wgrad_accumulation"):
        return []
    names = getattr(module, "weight_names", None)
    if names is None:  # LayerNormMLP: fc1 and fc2, each passed to its GEMM as is
        names = [n for n in ("fc1_weight", "fc2_weight") if isinstance(getattr(module, n, None), nn.Parameter)]
    elif len(names) != 1:
        return []
    return [getattr(module, n) for n in names]


@contextlib.contextmanager
def wgrad_into_main_grad(roots):
    """Within: TE's wgrad GEMMs under ``roots`` write each weight's gradient straight into
    ``weight.main_grad``, a buffer of the weight's dtype (fp32 for fp32 weights), overwriting it.

    TE's ``fuse_wgrad_accumulation`` with ``weight.overwrite_main_grad = True`` (read by TE in
    forward). By default TE's wgrad GEMM writes the gradient in the activation dtype (bf16), and
    autograd then casts it to the parameter's dtype: one more kernel per weight, 6 bytes moved per
    parameter. With this, TE returns *no* weight gradient to autograd: the caller hands
    ``main_grad`` to autograd itself. The buffers are allocated here, stay on the weights after
    exit (a CUDA graph captured within writes into them), and ``release_main_grad`` removes them.
    Modules with a frozen weight are left alone.

    Args:
        roots: modules whose submodules are switched (e.g. fp8vit's ``TE_Block`` instances).

    Yields:
        the weights that now get their gradient in ``main_grad``.
    """
    fused, weights = [], []
    for mod in (m for root in roots for m in root.modules()):
        ws = _gemm_weights(mod)
        if not ws or not all(w.requires_grad for w in ws) or mod.fuse_wgrad_accumulation:
            continue
        for w in ws:
            w.main_grad = torch.empty_like(w, memory_format=torch.contiguous_format)
            w.overwrite_main_grad = True  # TE: the GEMM writes (beta = 0), it does not accumulate
        mod.fuse_wgrad_accumulation = True
        fused.append(mod)
        weights.extend(ws)
    try:
        yield weights
    finally:
        # TE reads the switch in each eager forward: off again, an eager call computes and returns
        # its weight gradients as usual.
        for mod in fused:
            mod.fuse_wgrad_accumulation = False


def release_main_grad(weights) -> None:
    """Drop the ``main_grad`` buffers :func:`wgrad_into_main_grad` put on ``weights``."""
    for w in weights:
        for attr in ("main_grad", "overwrite_main_grad"):
            if attr in vars(w):
                delattr(w, attr)


def transformer_layer_class() -> type:
    """``te.TransformerLayer`` (the bench's speed reference; fp8vit's blocks do not use it)."""
    return load_te().TransformerLayer
