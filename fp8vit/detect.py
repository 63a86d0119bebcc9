"""What this machine can do: GPU description and FP8 support, detected once and cached.

Detection asks the hardware and TE, never version strings. Each answer is ``(ok, reason)``
and the reason is reused verbatim by ``fp8_context`` warnings and errors.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict, Optional, Tuple

import torch

from . import _te
from .recipes import MIN_CAPABILITY, RECIPE_NAMES, default_recipe_name

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
        recipes: ``{recipe: (ok, reason)}`` for every recipe in ``RECIPE_NAMES``.
        default_recipe: what ``fp8_context()`` uses when no recipe is named; None if FP8 is off.
        fp8: ``(ok, reason)`` for FP8 as a whole.
    """

    name: str
    capability: Optional[Tuple[int, int]]
    arch: str
    recipes: Dict[str, Tuple[bool, str]]
    default_recipe: Optional[str]
    fp8: Tuple[bool, str]

    def summary(self) -> str:
        """One human-readable paragraph, as printed by the examples."""
        cap = "" if self.capability is None else f" (sm_{self.capability[0]}{self.capability[1]}, {self.arch})"
        lines = [f"device: {self.name}{cap}",
                 f"FP8: {'yes, default recipe ' + repr(self.default_recipe) if self.fp8[0] else 'off: ' + self.fp8[1]}"]
        for name, (ok, why) in self.recipes.items():
            lines.append(f"  {name:8s} {'ok' if ok else 'no: ' + why}")
        return "\n".join(lines)


def _device() -> Tuple[str, Optional[Tuple[int, int]]]:
    """(name, capability) of the current CUDA device; ("cpu", None) without one. Patched in tests."""
    if not torch.cuda.is_available():
        return "cpu", None
    idx = torch.cuda.current_device()
    return torch.cuda.get_device_name(idx), tuple(torch.cuda.get_device_capability(idx))


def _recipe_support(capability: Optional[Tuple[int, int]], name: str) -> Dict[str, Tuple[bool, str]]:
    """``{recipe: (ok, reason)}``: hardware first, then TE's own checks."""
    if capability is None:
        why = (f"no CUDA GPU is visible (torch {torch.__version__}, "
               f"built with CUDA {torch.version.cuda or 'none'})")
        return {r: (False, why) for r in RECIPE_NAMES}
    out = {}
    for r in RECIPE_NAMES:
        need = MIN_CAPABILITY[r]
        if capability < need:
            out[r] = (False, f"{name} has compute capability {capability[0]}.{capability[1]} "
                             f"({arch_name(capability)}); recipe {r!r} needs {need[0]}.{need[1]}+")
    te_ok, te_reason = _te.te_status()
    if not te_ok:
        return {r: out.get(r, (False, te_reason)) for r in RECIPE_NAMES}
    checks = _te.recipe_checks()
    return {r: out.get(r, checks[r]) for r in RECIPE_NAMES}


@functools.lru_cache(maxsize=None)
def gpu_info() -> GPUInfo:
    """Describe the current device and which FP8 recipes run on it. Cached; see :func:`clear_cache`."""
    name, cap = _device()
    recipes = _recipe_support(cap, name)
    default = default_recipe_name(recipes)
    if default is not None:
        fp8 = (True, "")
    else:
        # The reason of the most basic recipe is the most useful one to show.
        fp8 = (False, recipes["delayed"][1])
    return GPUInfo(name=name, capability=cap, arch=arch_name(cap) if cap else "none",
                   recipes=recipes, default_recipe=default, fp8=fp8)


def fp8_support() -> Tuple[bool, str]:
    """Whether FP8 training can run here.

    Returns:
        ``(ok, reason)``; ``reason`` is empty when ok, else says why FP8 is off and what would fix it.
    """
    return gpu_info().fp8


def clear_cache() -> None:
    """Forget cached detection results (e.g. after changing ``CUDA_VISIBLE_DEVICES``)."""
    gpu_info.cache_clear()
