"""``fp8_context``: torch autocast plus TE's FP8 autocast, with a clear fallback."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional, Union

import torch

from . import _te
from ._warn import warn_once
from .detect import gpu_info
from .errors import FP8UnavailableError
from .recipes import check_recipe_name, make_recipe, recipe_name

__all__ = ["fp8_context", "FP8State"]

@dataclasses.dataclass(frozen=True)
class FP8State:
    """What an ``fp8_context`` actually enabled (yielded by the context manager).

    Attributes:
        fp8: whether TE's FP8 autocast is on.
        recipe: the TE recipe object in use, or None.
        recipe_name: ``"delayed"``, ``"current"``, ``"block"``, ``"mxfp8"``, ``"custom"`` or None.
        dtype: the torch autocast dtype (None if torch autocast is off).
        reason: why FP8 is off (empty when on, or when it was not asked for).
    """

    fp8: bool
    recipe: Any
    recipe_name: Optional[str]
    dtype: Optional[torch.dtype]
    reason: str = ""


def _resolve(recipe: Union[None, str, Any], info) -> Any:
    """Recipe argument -> TE recipe object, checking that this GPU can run it."""
    if recipe is None:
        return make_recipe(info.default_recipe)
    if isinstance(recipe, str):
        ok, why = info.recipes[recipe]
        if not ok:
            usable = [n for n, (o, _) in info.recipes.items() if o]
            raise FP8UnavailableError(f"FP8 recipe {recipe!r} cannot run here: {why}. "
                                      f"Recipes this GPU supports: {usable}")
        return make_recipe(recipe)
    return recipe  # a TE recipe object: TE validates it on first use


@contextlib.contextmanager
def fp8_context(
    recipe: Union[None, str, Any] = None,
    *,
    enabled: bool = True,
    dtype: Optional[torch.dtype] = torch.bfloat16,
    strict: bool = False,
) -> Iterator[FP8State]:
    """Run the enclosed forward pass in ``dtype`` autocast and, where possible, TE FP8.

    Wrap the forward pass (and the loss) only; call ``backward()`` outside, as with
    ``torch.autocast``. TE modules run their FP8 GEMMs; everything else (patch embedding,
    head, loss) runs under torch autocast.

    Args:
        recipe: a TE recipe object, or a name: ``"delayed"``, ``"current"``, ``"block"``,
            ``"mxfp8"``. None picks the best one this GPU supports (MXFP8 on Blackwell, delayed
            scaling on Hopper and Ada).
        enabled: False runs ``dtype`` autocast only, with no warning.
        dtype: torch autocast dtype; None leaves torch autocast off.
        strict: raise :class:`FP8UnavailableError` instead of falling back when FP8 cannot run.

    Yields:
        :class:`FP8State` saying what is actually on.

    Raises:
        ValueError: ``recipe`` is an unknown name.
        FP8UnavailableError: a named recipe this GPU cannot run, or no FP8 and ``strict``.
    """
    info = gpu_info()
    device_type = "cuda" if info.capability is not None else "cpu"
    if isinstance(recipe, str):
        check_recipe_name(recipe)  # a typo is an error everywhere, not only on FP8 GPUs
    use_fp8, te_recipe, reason = False, None, ""
    if enabled:
        ok, reason = info.fp8
        if ok:
            te_recipe, use_fp8 = _resolve(recipe, info), True
        elif strict:
            raise FP8UnavailableError(f"FP8 was required (strict=True) but cannot run: {reason}")
        else:
            warn_once(f"fp8vit: FP8 is off, running in bf16/autocast only: {reason}",
                      RuntimeWarning, stacklevel=3)
    state = FP8State(fp8=use_fp8, recipe=te_recipe,
                     recipe_name=recipe_name(te_recipe) if use_fp8 else None,
                     dtype=dtype, reason=reason)
    with contextlib.ExitStack() as stack:
        if dtype is not None:
            stack.enter_context(torch.autocast(device_type, dtype=dtype))
        if use_fp8:
            stack.enter_context(_te.autocast(enabled=True, recipe=te_recipe))
        yield state
