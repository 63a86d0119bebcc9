"""What a TE module saves and pickles: FP8 scaling state as plain tensors, and modules that
``torch.save(model)`` can pickle whole.

TE stores delayed scaling's scales and amax histories in ``_extra_state`` as a pickled byte
tensor, and since 2.20 refuses to load it without ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1`` (a
pickle can run arbitrary code). :class:`SafeExtraState` stores the same state without a pickle, as
one uint8 tensor (:func:`encode_state`): a JSON header (the recipe's settings, TE's plain
``fp8_meta`` values, the tensors' shapes) and the float32 bytes of the scales and histories. A
tensor, because every checkpoint writer takes one: ``torch.save`` read back with
``weights_only=True``, DCP (no unpickling on load) and safetensors (accelerate's ``save_state``,
which refused the dict of fp8vit 0.1; that dict still loads).

The tensor has one size per module, whether the module ran FP8 or not, with any recipe up to TE's
default history of 1024 (:func:`state_bytes`; zero padding after the state): code that walks two
models' state dicts side by side copies one into the other, and timm's ``ModelEmaV3`` does so with
an EMA copy made before the first FP8 step (``ema_v.copy_(model_v)``). A ViT-B holds 48 such
tensors of 20-41 KB.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Optional

import torch

from .loader import te_module
from .recipe_switch import BUFFER_KEY

__all__ = ["EXTRA_STATE_FORMAT", "SafeExtraState", "encode_state", "decode_state", "state_bytes"]

# Format tag of the FP8 scaling state fp8vit writes: v2 is the tensor (encode_state), v1 the dict of
# fp8vit 0.1 (still read).
EXTRA_STATE_FORMAT = "fp8vit.delayed_scaling.v2"
_V1 = "fp8vit.delayed_scaling.v1"
_MAGIC = (EXTRA_STATE_FORMAT + "\n").encode()
_TENSORS = ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")
# The fixed size covers histories up to TE's default length and a header up to _HEADER_BYTES; a
# longer one makes a larger tensor (still loaded; two such models' sizes may then differ).
_HISTORY_CAP = 1024
_HEADER_BYTES = 2048
# GEMMs per TE module (TE sets fp8_meta["num_gemms"] only once FP8 has run): 3 FP8 tensors each
# forward (input, weight, output), 2 backward (the gradients).
_GEMMS = {"LayerNormMLP": 2, "DotProductAttention": 3}


def state_bytes(gemms: int) -> int:
    """Size of the state tensor of a module with ``gemms`` GEMMs (history up to 1024)."""
    floats = 5 * gemms * (1 + _HISTORY_CAP)  # scales and histories, forward and backward
    return len(_MAGIC) + _HEADER_BYTES + 1 + 4 * floats




def encode_state(state: Optional[Dict[str, Any]], size: int = 0) -> torch.Tensor:
    """The scaling state (a dict: ``recipe``, ``extra_fp8_variables`` and the float tensors named in
    ``_TENSORS``; None: no state) as one uint8 tensor: the format tag and a newline, the JSON header
    and a newline, then each tensor's float32 bytes (little-endian, as every CUDA host) in the
    header's order, then zeros up to ``size`` bytes where it is longer."""
    if state is None:
        header, parts = {"empty": True}, []
    else:
        tensors = [state[k].detach().to("cpu", torch.float32).contiguous() for k in _TENSORS]
        header = {"recipe": state["recipe"], "extra_fp8_variables": state["extra_fp8_variables"],
                  "shapes": [list(t.shape) for t in tensors]}
        parts = [t.flatten().view(torch.uint8) for t in tensors]
    head = torch.frombuffer(bytearray(_MAGIC + json.dumps(header).encode() + b"\n"), dtype=torch.uint8)
    used = len(head) + sum(len(p) for p in parts)
    return torch.cat([head, *parts, torch.zeros(max(0, size - used), dtype=torch.uint8)])


def decode_state(blob: Any) -> Optional[Dict[str, Any]]:
    """The dict :func:`encode_state` encoded (``{}`` for no state; also fp8vit 0.1's dict as it was
    saved), or None for anything else (TE's own pickled state, an empty tensor)."""
    if isinstance(blob, dict):
        return blob if blob.get("format") == _V1 else None
    if not (isinstance(blob, torch.Tensor) and blob.dtype == torch.uint8 and blob.dim() == 1):
        return None
    raw = blob.detach().cpu()
    if bytes(raw[:len(_MAGIC)].tolist()) != _MAGIC:
        return None
    data = bytes(raw.tolist())
    end = data.index(b"\n", len(_MAGIC))
    header = json.loads(data[len(_MAGIC):end])
    if header.get("empty"):
        return {}
    state = {"recipe": header["recipe"], "extra_fp8_variables": header["extra_fp8_variables"]}
    sizes = [4 * int(torch.Size(shape).numel()) for shape in header["shapes"]]
    used = end + 1 + sum(sizes)
    if used > len(data) or any(data[used:]):  # after the state: zero padding only
        raise ValueError(f"fp8vit FP8 scaling state: {len(data)} bytes where its header describes "
                         f"{used} and zero padding; the checkpoint is damaged")
    offset = end + 1
    for name, shape, n in zip(_TENSORS, header["shapes"], sizes):
        # clone: a slice at an offset that is not a multiple of 4 cannot be viewed as float32
        state[name] = raw[offset:offset + n].clone().view(torch.float32).reshape(shape)
        offset += n
    return state


class SafeExtraState:
    """Mixin for TE modules: FP8 delayed-scaling state as plain tensors, never a pickle; and
    modules that pickle whole (``torch.save(model)``).

    The state is one uint8 tensor of one size per module (:func:`encode_state`, see the module
    docstring). Stateless recipes (current, block, mxfp8) and modules that never ran FP8 store a
    header that says so. Old TE pickles and TE's empty tensor still go through TE's own (guarded)
    loader.
    """

    def _state_bytes(self) -> int:
        gemms = next((_GEMMS[c.__name__] for c in type(self).__mro__ if c.__name__ in _GEMMS), 1)
        return state_bytes(gemms)

    def get_extra_state(self):
        meta = self.fp8_meta
        recipe = meta.get("recipe")
        ran_fp8 = meta.get("fp8_checkpoint") or self.fp8 or self.fp8_calibration
        if not ran_fp8 or recipe is None or not recipe.delayed() or "scaling_fwd" not in meta:
            return encode_state(None, self._state_bytes())
        if callable(recipe.amax_compute_algo) or recipe.scaling_factor_compute_algo is not None:
            raise ValueError(
                f"cannot checkpoint DelayedScaling with a custom callable ({recipe}); "
                "fp8vit stores scaling state without pickles: use amax_compute_algo='max' or "
                "'most_recent' and no scaling_factor_compute_algo"
            )
        extra = {
            k: v for k, v in meta.items()
            if k != BUFFER_KEY and isinstance(v, (bool, int, float, str))
        }
        return encode_state({
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
        }, self._state_bytes())

    def set_extra_state(self, state):
        decoded = decode_state(state)
        if decoded is None:
            return super().set_extra_state(state)
        if not decoded:  # saved by a module with no state (never ran FP8, or a stateless recipe)
            return None
        state = decoded
        rec = te_module("transformer_engine.common.recipe")
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
        # Also what copy.deepcopy reads (ModelEmaV3, a teacher copied from its student).
        state = super().__getstate__()
        inits = state.get("param_init_meta")
        if isinstance(inits, dict):
            state = dict(state, param_init_meta={n: m.fp8_meta_index for n, m in inits.items()})
        meta = state.get("fp8_meta")
        if isinstance(meta, dict) and any(k in meta for k in _PROCESS_POSITIONS):
            # The copy's scaling tensors are its own: it must enter TE's process-wide
            # delayed-scaling buffers itself. With the original's positions it never would (TE
            # registers a module once, when the key is absent), and its scales would stay as copied.
            state = dict(state, fp8_meta={k: v for k, v in meta.items() if k not in _PROCESS_POSITIONS})
        return state

    def __setstate__(self, state):
        inits = state.get("param_init_meta")
        if isinstance(inits, dict) and all(v is None or isinstance(v, int) for v in inits.values()):
            meta_cls = te_module("transformer_engine.pytorch.module._common")._ParameterInitMeta
            state = dict(state, param_init_meta={
                n: meta_cls(init_fn=_UnpickledInit(type(self).__name__, n), fp8_meta_index=i)
                for n, i in inits.items()})
        super().__setstate__(state)


# fp8_meta keys that hold a module's positions in TE's process-wide state (TE 2.x): its slot in the
# delayed-scaling amax/scale buffers (``FP8GlobalStateManager.get_buffer_info()``) and in the stash
# of scaling tensors for activation recompute.
_PROCESS_POSITIONS = (BUFFER_KEY, "global_fp8_buffer_pos_fwd_recompute")


def _is_local(fn, name: str) -> bool:
    return getattr(fn, "__qualname__", "").endswith(f"<locals>.{name}")


def _attention_mask_func(x, y):
    """TE's ``UnfusedDotProductAttention.mask_func``, picklable (same names, same module)."""
    b = te_module("transformer_engine.pytorch.attention.dot_product_attention.backends")
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
