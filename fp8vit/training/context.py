"""``fp8_context``: torch autocast plus TE's FP8 autocast, with a clear fallback."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, ContextManager, Iterator, Optional, Union

import torch

from .. import _te
from .._validate import check_bool, check_choice, check_process_group
from .._warn import warn_once
from .detect import gpu_info
from .._te.recipes import check_recipe, recipe_name
from .detect import resolve_recipe

__all__ = ["fp8_context", "FP8State", "AUTOCAST_DTYPES", "check_autocast_dtype", "active_fp8_state"]

# What torch autocast can run FP8's surrounding ops in (TE's GEMM outputs are in this dtype too).
AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)


def check_autocast_dtype(fn: str, dtype: Optional[torch.dtype], *, none_ok: bool = False) -> Optional[torch.dtype]:
    """``dtype`` if it is one of :data:`AUTOCAST_DTYPES` (or None, "no torch autocast", with ``none_ok``).

    Raises:
        TypeError: not a ``torch.dtype``.
        ValueError: a dtype autocast cannot run in.
    """
    return check_choice(fn, "dtype", dtype, AUTOCAST_DTYPES, none_ok=none_ok,
                        also=" (no torch autocast)" if none_ok else "")


def active_fp8_state() -> Optional["FP8State"]:
    """The :class:`FP8State` of the innermost ``fp8_context`` being run (FP8 on or off), or None
    outside every one (``set_fp8_autocast``'s forward then enters one itself)."""
    return _ACTIVE.get()


@dataclasses.dataclass(frozen=True)
class FP8State:
    """What an ``fp8_context`` actually enabled (yielded by the context manager).

    Attributes:
        fp8: whether TE's FP8 autocast is on.
        recipe: the TE recipe object in use, or None. For a recipe name it is the one object this
            process uses for that name at every step: for other settings, pass an object of your
            own (e.g. ``make_recipe("delayed")``, changed) rather than change this one.
        recipe_name: ``"delayed"``, ``"current"``, ``"block"``, ``"mxfp8"``, ``"custom"`` or None.
        dtype: the torch autocast dtype in effect (None if torch autocast is off).
        reason: why FP8 is off (empty when on, or when it was not asked for).
    """

    fp8: bool
    recipe: Any
    recipe_name: Optional[str]
    dtype: Optional[torch.dtype]
    reason: str = ""


_ACTIVE: contextvars.ContextVar[Optional[FP8State]] = contextvars.ContextVar("fp8vit_fp8_context", default=None)


def fp8_context(
    recipe: Union[None, str, Any] = None,
    *,
    enabled: bool = True,
    dtype: Optional[torch.dtype] = torch.bfloat16,
    strict: bool = False,
    amax_reduction_group: Any = None,
) -> ContextManager[FP8State]:
    """Run the enclosed forward pass in ``dtype`` autocast and, where possible, TE FP8.

    Wrap the forward pass (and the loss) only; call ``backward()`` outside, as with
    ``torch.autocast``. TE modules run their FP8 GEMMs; everything else (patch embedding,
    head, loss) runs under torch autocast, on the GPU and on the CPU alike (a model left on the
    CPU of a GPU machine is autocast too).

    Args:
        recipe: a TE recipe object, or a name: ``"delayed"``, ``"current"``, ``"block"``,
            ``"mxfp8"``. None picks the best one this GPU supports (MXFP8 on Blackwell, delayed
            scaling on Hopper and Ada) and falls back to ``dtype`` autocast, with one warning,
            where FP8 cannot run.
        enabled: False runs ``dtype`` autocast only, with no warning.
        dtype: torch autocast dtype, ``torch.bfloat16`` or ``torch.float16``; None leaves torch
            autocast off.
        strict: with ``recipe=None``, raise instead of falling back when FP8 cannot run.
        amax_reduction_group: the data-parallel process group (``torch.distributed`` group) over
            which delayed scaling's amaxes are max-reduced at the end of the forward and of the
            backward, so that every rank computes the same FP8 scales. None: TE reduces over the
            default (world) group whenever ``torch.distributed`` is initialized, which is right
            for DDP and for FSDP2 over all ranks; pass the data-parallel group where ranks also
            split the model (tensor or pipeline parallelism), whose other ranks run other
            modules. Ignored where FP8 is off; stateless recipes reduce nothing.

    Returns:
        a context manager; entering it gives the :class:`FP8State` saying what is actually on.

    Raises:
        TypeError: at the call: ``recipe`` is neither a name nor a TE recipe object, ``enabled`` or
            ``strict`` is not a bool, ``dtype`` not a ``torch.dtype``, ``amax_reduction_group`` not
            a process group.
        ValueError: at the call: ``recipe`` is an unknown name (on every machine, not only on FP8
            GPUs), or ``dtype`` is not one autocast can use.
        FP8UnavailableError: on entering: a recipe was named (or ``strict``) and cannot run here;
            the message says why and which recipes can.
    """
    fn = "fp8_context"
    check_recipe(fn, recipe)
    check_bool(fn, "enabled", enabled)
    check_autocast_dtype(fn, dtype, none_ok=True)
    check_bool(fn, "strict", strict)
    check_process_group(fn, "amax_reduction_group", amax_reduction_group)
    return _fp8_context(recipe, enabled, dtype, strict, amax_reduction_group)


@contextlib.contextmanager
def _fp8_context(recipe, enabled: bool, dtype: Optional[torch.dtype], strict: bool,
                 amax_reduction_group: Any) -> Iterator[FP8State]:
    """:func:`fp8_context` once its arguments are checked."""
    info = gpu_info()
    use_fp8, te_recipe, reason = False, None, ""
    if enabled:
        if info.fp8.ok or recipe is not None or strict:
            # Raises FP8UnavailableError with the reason where the asked-for FP8 cannot run.
            te_recipe, use_fp8 = resolve_recipe(recipe, info.recipes), True
        else:
            reason = info.fp8.reason
            warn_once(f"fp8vit: FP8 is off, running in bf16/autocast only: {reason}",
                      RuntimeWarning, stacklevel=3)
    state = FP8State(fp8=use_fp8, recipe=te_recipe,
                     recipe_name=recipe_name(te_recipe) if use_fp8 else None,
                     dtype=dtype, reason=reason)
    with contextlib.ExitStack() as stack:
        if dtype is not None:
            stack.enter_context(torch.autocast("cpu", dtype=dtype))
            if info.capability is not None:
                stack.enter_context(torch.autocast("cuda", dtype=dtype))
        if use_fp8:
            stack.enter_context(_te.autocast(enabled=True, recipe=te_recipe, amax_reduction_group=amax_reduction_group))
        token = _ACTIVE.set(state)
        try:
            yield state
        finally:
            _ACTIVE.reset(token)
