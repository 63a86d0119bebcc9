"""What this machine can do: GPU description and FP8 support, detected once and cached.

Detection asks the hardware and TE, never version strings. Each answer is a :class:`Check`
``(ok, reason)`` and the reason is reused verbatim by ``fp8_context`` warnings and errors.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict, Optional, Tuple

import torch

from . import _te
from .errors import Check
from .kernels import triton_support
from .recipes import default_recipe_name, recipe_support

__all__ = ["GPUInfo", "gpu_info", "fp8_support", "clear_cache", "arch_name"]

_ARCH = {(7, 0): "Volta", (7, 5): "Turing", (8, 0): "Ampere", (8, 6): "Ampere", (8, 7): "Ampere",
         (8, 9): "Ada", (9, 0): "Hopper", (10, 0): "Blackwell", (10, 3): "Blackwell",
         (11, 0): "Blackwell", (12, 0): "Blackwell", (12, 1): "Blackwell"}


def arch_name(capability: Tuple[int, int]) -> str:
    """Marketing name of a compute capability, e.g. ``(9, 0) -> "Hopper"``."""
    if capability in _ARCH:
        return _ARCH[capability]
    return "Blackwell or newer" if capability >= (10, 0) else "unknown"


@dataclasses.dataclass(frozen=True)
class GPUInfo:
    """What fp8vit found on this machine.

    Attributes:
        name: device name (``"cpu"`` without CUDA).
        capability: compute capability, e.g. ``(9, 0)``; None without CUDA.
        arch: architecture name, e.g. ``"Hopper"``.
        recipes: ``{recipe: Check}`` for every recipe in ``RECIPE_NAMES``.
        default_recipe: what ``fp8_context()`` uses when no recipe is named; None if FP8 is off.
        fp8: :class:`Check` for FP8 as a whole.
    """

    name: str
    capability: Optional[Tuple[int, int]]
    arch: str
    recipes: Dict[str, Check]
    default_recipe: Optional[str]
    fp8: Check

    def summary(self) -> str:
        """One human-readable paragraph, as printed by the examples."""
        cap = "" if self.capability is None else f" (sm_{self.capability[0]}{self.capability[1]}, {self.arch})"
        fp8 = f"yes, default recipe {self.default_recipe!r}" if self.fp8.ok else f"off: {self.fp8.reason}"
        lines = [f"device: {self.name}{cap}", f"FP8: {fp8}"]
        for name, check in self.recipes.items():
            lines.append(f"  {name:8s} {'ok' if check.ok else 'no: ' + check.reason}")
        return "\n".join(lines)


def _device() -> Tuple[str, Optional[Tuple[int, int]]]:
    """(name, capability) of the current CUDA device; ("cpu", None) without one."""
    if not torch.cuda.is_available():
        return "cpu", None
    idx = torch.cuda.current_device()
    return torch.cuda.get_device_name(idx), tuple(torch.cuda.get_device_capability(idx))


@functools.lru_cache(maxsize=None)
def gpu_info() -> GPUInfo:
    """Describe the current device and which FP8 recipes run on it. Cached; see :func:`clear_cache`."""
    name, cap = _device()
    arch = arch_name(cap) if cap else "none"
    recipes = recipe_support(cap, name, arch)
    default = default_recipe_name(recipes)
    # Without any recipe, the reason of the most basic one is the most useful to show.
    fp8 = Check(True) if default is not None else recipes["delayed"]
    return GPUInfo(name=name, capability=cap, arch=arch, recipes=recipes, default_recipe=default, fp8=fp8)


def fp8_support() -> Check:
    """Whether FP8 training can run here.

    Returns:
        ``Check(ok, reason)``; ``reason`` is empty when ok, else says why FP8 is off and what would
        fix it.
    """
    return gpu_info().fp8


def clear_cache() -> None:
    """Forget every cached detection result (e.g. after changing ``CUDA_VISIBLE_DEVICES``).

    Clears the device description, TE's import status and capability answers, and whether
    fp8vit's Triton kernels run, so a TE or Triton installed or repaired since then is seen.
    """
    gpu_info.cache_clear()
    _te.clear_cache()
    triton_support.cache_clear()
