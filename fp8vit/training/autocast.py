"""FP8 carried by the model: :func:`set_fp8_autocast` runs the model's own forward inside fp8vit's
FP8 context, so that an unchanged bf16 training loop trains the fused blocks in FP8.

    fp8vit.convert_to_te(model, autocast=True)         # or fp8vit.set_fp8_autocast(model)
    for x, y in loader:                                # no fp8_context in the loop
        with torch.autocast("cuda", dtype=torch.bfloat16):   # the loop's own AMP, or none
            loss = F.cross_entropy(model(x), y)
        loss.backward()

The forward is an instance attribute of the model (an object, not a closure: the model pickles and
deep-copies), called by ``model(x)`` and by the wrappers that call the module (DDP, FSDP2, an EMA
copy). It adds no parameter, buffer or state-dict key.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Optional

import torch
from torch import nn

from .. import _te
from .._validate import check_bool, check_model, check_process_group
from .._te.recipes import check_recipe, recipe_name
from ..blocks.base import FP8Block
from ..blocks.linear import is_swapped
from . import context as _context
from .context import check_autocast_dtype

__all__ = ["set_fp8_autocast", "FP8Forward", "fp8_forward", "own_forward", "set_own_forward",
           "remove_fp8_autocast", "describe_fp8_autocast"]


class FP8Forward:
    """``model.forward`` after :func:`set_fp8_autocast`: the forward beneath it (the class's, or an
    instance forward installed earlier: :attr:`inner`) inside fp8vit's FP8 context.

    Per call: inside an ``fp8_context`` (FP8 on or off) or TE's own FP8 autocast, it calls through,
    and that context decides (its recipe; no second amax reduction). Else, where torch autocast is
    on for the input's device (the loop's AMP), it enters TE's FP8 autocast only and keeps that
    dtype; with none, it enters ``fp8_context(recipe, dtype=dtype, amax_reduction_group=...)``:
    ``dtype`` autocast and FP8 (bf16 with ``fp8_context``'s one warning where FP8 cannot run); its
    outputs in ``dtype`` then come back in fp32, so that the loss after it is computed as inside
    autocast (accelerate's ``convert_outputs_to_fp32`` does the same).
    """

    def __init__(self, model: nn.Module, inner: Any, recipe: Any, dtype: torch.dtype, amax_reduction_group: Any):
        self.model = model
        self.inner = inner
        self.recipe = recipe
        self.dtype = dtype
        self.amax_reduction_group = amax_reduction_group

    def _callee(self):
        return self.inner if self.inner is not None else type(self.model).forward.__get__(self.model)

    # torch.compile: this frame runs eagerly (it reads and enters Python-side contexts), the forward
    # it calls is compiled as its own frame, under the autocast state entered here.
    @torch.compiler.disable(recursive=False)
    def __call__(self, *args, **kwargs):
        forward = self._callee()
        if _context.active_fp8_state() is not None or _te.active_fp8_recipe() is not None:
            return forward(*args, **kwargs)
        if _caller_autocast(self.model, args, kwargs):
            with _context._fp8_context(self.recipe, True, None, False, self.amax_reduction_group):
                return forward(*args, **kwargs)
        with _context._fp8_context(self.recipe, True, self.dtype, False, self.amax_reduction_group):
            out = forward(*args, **kwargs)
        # The loss follows, outside this autocast: hand it fp32, as autocast would (its fp32 ops:
        # cross entropy, softmax), so that it is computed as in the explicit fp8_context loop.
        return _cast_outputs(out, self.dtype)

    @property
    def __signature__(self) -> inspect.Signature:
        """The signature of the forward beneath (frameworks read it to route inputs)."""
        return inspect.signature(self._callee())

    def describe(self) -> str:
        """The settings in words (the model's repr and ``conversion_summary`` show them)."""
        if self.recipe is None:
            recipe = "the GPU's default"
        elif isinstance(self.recipe, str):
            recipe = repr(str(self.recipe))
        else:
            recipe = f"{recipe_name(self.recipe)!r} ({type(self.recipe).__name__})"
        group = "" if self.amax_reduction_group is None else ", amaxes reduced over the given group"
        return (f"inside the model's forward (set_fp8_autocast: recipe {recipe}, {self.dtype} autocast unless the "
                f"caller's is on{group})")

    def __repr__(self) -> str:
        return f"<fp8vit FP8 forward of {type(self.model).__name__}: {self.describe()}>"

    def __getstate__(self) -> dict:
        if self.amax_reduction_group is not None:
            raise TypeError(f"this {type(self.model).__name__} carries FP8 with an amax_reduction_group (a "
                            "torch.distributed process group), which cannot be pickled: call "
                            "fp8vit.set_fp8_autocast(model, amax_reduction_group=None) before saving it whole and set "
                            "the group again after loading, or save model.state_dict()")
        return dict(vars(self))

    def __deepcopy__(self, memo: dict) -> "FP8Forward":
        # A copy (an EMA model) runs in the same processes: it shares the process group.
        new = object.__new__(type(self))
        memo[id(self)] = new
        for key, value in vars(self).items():
            setattr(new, key, value if key == "amax_reduction_group" else copy.deepcopy(value, memo))
        return new


class _FP8Repr:
    """``model.extra_repr`` after :func:`set_fp8_autocast`: the class's own lines, then one saying
    that FP8 runs inside the model. An object, so that the model pickles."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self) -> str:
        own = type(self.model).extra_repr(self.model)
        mine = describe_fp8_autocast(self.model)
        return "\n".join(s for s in (own, mine and f"fp8vit: FP8 {mine}") if s)


def _caller_autocast(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether torch autocast is on for the device of the input (else of the model's parameters)."""
    device = next((a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type)


def _cast_outputs(out: Any, low: torch.dtype) -> Any:
    """``out`` (a tensor, or tuples, lists and dicts of them) with its ``low`` tensors cast to fp32."""
    if isinstance(out, torch.Tensor):
        return out.float() if out.dtype == low else out
    if isinstance(out, tuple) and hasattr(out, "_fields"):  # a namedtuple
        return type(out)(*(_cast_outputs(o, low) for o in out))
    if isinstance(out, (list, tuple)):
        return type(out)(_cast_outputs(o, low) for o in out)
    if isinstance(out, dict):
        return type(out)((k, _cast_outputs(v, low)) for k, v in out.items())
    return out


def fp8_forward(model: nn.Module) -> Optional[FP8Forward]:
    """The :class:`FP8Forward` :func:`set_fp8_autocast` installed on ``model``, or None."""
    forward = vars(model).get("forward")
    return forward if isinstance(forward, FP8Forward) else None


def own_forward(module: nn.Module) -> Any:
    """The instance ``forward`` of ``module`` beneath an :class:`FP8Forward` (None: the class's)."""
    forward = vars(module).get("forward")
    return forward.inner if isinstance(forward, FP8Forward) else forward


def set_own_forward(module: nn.Module, forward: Any) -> None:
    """Install (None: remove) ``module``'s instance ``forward``, beneath its :class:`FP8Forward` if it has one
    (``set_grad_checkpointing``'s, on a model that is itself a block)."""
    outer = fp8_forward(module)
    if outer is not None:
        outer.inner = forward
    elif forward is not None:
        module.forward = forward
    elif "forward" in vars(module):
        del module.forward


def describe_fp8_autocast(model: nn.Module) -> Optional[str]:
    """Where FP8 runs, in words, if ``model`` carries it (:func:`set_fp8_autocast`); else None.

    A forward wrapped around it after the fact still counts: accelerate's ``prepare`` installs its
    autocast wrapper as the instance ``forward`` and keeps the one beneath as ``_original_forward``;
    ``functools.wraps`` wrappers keep it as ``__wrapped__``."""
    for forward in (vars(model).get("forward"), vars(model).get("_original_forward")):
        for _ in range(8):  # a chain of wrappers, bounded
            if isinstance(forward, FP8Forward):
                return forward.describe()
            forward = getattr(forward, "__wrapped__", None)
    return None


def remove_fp8_autocast(model: nn.Module) -> bool:
    """Undo :func:`set_fp8_autocast` (the forward beneath it stays). Returns whether there was one."""
    forward = fp8_forward(model)
    if isinstance(vars(model).get("extra_repr"), _FP8Repr):
        del model.extra_repr
    if forward is None:
        return False
    del model.forward
    if forward.inner is not None:
        model.forward = forward.inner
    return True


def _holds_fp8(model: nn.Module) -> bool:
    return any(isinstance(m, FP8Block) or is_swapped(m) for m in model.modules())


def set_fp8_autocast(model: nn.Module, enabled: bool = True, *, recipe: Any = None,
                     dtype: torch.dtype = torch.bfloat16, amax_reduction_group: Any = None) -> nn.Module:
    """Carry FP8 in ``model``: its forward runs its FP8 blocks in FP8 with no ``fp8_context`` in the loop.

    In place, like ``set_grad_checkpointing``. After it, an unchanged bf16 loop trains in FP8: with
    the loop's own ``torch.autocast`` (or a framework's AMP) around the forward, whose dtype is kept
    (TE's FP8 autocast is entered inside it), or with none (``dtype`` autocast is entered too). Train
    and eval mode, ``no_grad`` and ``inference_mode`` alike. An ``fp8_context`` (or TE's autocast)
    around the forward takes precedence: the model then calls through, with no second context and
    no second amax reduction; ``fp8_context(enabled=False)`` runs it without FP8. Where FP8 cannot
    run the model runs in ``dtype`` autocast, with ``fp8_context``'s one warning. Outputs computed
    under its own autocast come back in fp32 (a loss computed after it then runs as it would inside
    autocast, as in the explicit loop).

    Call it on the model before DDP or FSDP2 wrap it (their forward calls the model's); CUDA graphs
    (:func:`make_graphed_blocks`) replay inside it when captured with the same recipe. Calling it
    again replaces the settings (e.g. the process group, once it exists); the state dict is
    unchanged. ``conversion_summary`` and ``print(model)`` say that FP8 runs inside the model.

    Args:
        model: a converted model (holding fp8vit blocks or FP8 Linears).
        enabled: False removes it (the model needs ``fp8_context`` again).
        recipe: the FP8 recipe: a name (``"delayed"``, ``"current"``, ``"block"``, ``"mxfp8"``), a TE
            recipe object, or None: the GPU's default (as ``fp8_context``; a named recipe that cannot
            run here raises at the forward).
        dtype: the autocast dtype entered when the caller runs none, ``torch.bfloat16`` or
            ``torch.float16``.
        amax_reduction_group: as ``fp8_context``'s (None: TE's default group, right for DDP and
            FSDP2 over all ranks).

    Returns:
        ``model``.

    Raises:
        TypeError: ``model`` not a module, ``enabled`` not a bool, ``recipe`` neither a name nor a
            TE recipe object, ``dtype`` not a ``torch.dtype``, ``amax_reduction_group`` not a
            process group.
        ValueError: an unknown recipe name, a dtype autocast cannot run in, or (``enabled``) a
            model holding no fp8vit block or FP8 Linear (convert it first); nothing is changed.
    """
    fn = "set_fp8_autocast"
    check_model(fn, model)
    check_bool(fn, "enabled", enabled)
    check_recipe(fn, recipe)
    check_autocast_dtype(fn, dtype)
    check_process_group(fn, "amax_reduction_group", amax_reduction_group)
    if not enabled:
        remove_fp8_autocast(model)
        return model
    if not _holds_fp8(model):
        raise ValueError(f"set_fp8_autocast: this {type(model).__name__} holds no fp8vit block (TE_Block, ...) and no "
                         "FP8 Linear, so nothing in it would run FP8; run fp8vit.convert_to_te(model) first "
                         "(or convert_to_te(model, autocast=True))")
    model.forward = FP8Forward(model, own_forward(model), recipe, dtype, amax_reduction_group)
    if not isinstance(vars(model).get("extra_repr"), _FP8Repr):
        model.extra_repr = _FP8Repr(model)
    return model
