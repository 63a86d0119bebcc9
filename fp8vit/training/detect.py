"""What this machine can do: GPU description, which FP8 recipes run on it and which is the
default, detected once and cached.

Detection asks the hardware and TE, never version strings. Each answer is a :class:`Check`
``(ok, reason)`` and the reason is reused verbatim by ``fp8_context`` warnings and errors.
Whether a recipe runs is decided first by the compute capability (:data:`MIN_CAPABILITY`), then
by TE's own check; the capability table is what fp8vit reports when TE is not there to ask.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, Optional, Tuple, Union

import torch

from .. import _te
from ..errors import Check, FP8UnavailableError
from .._te.kernels import rope_support, triton_support
from .._te.recipes import RECIPE_NAMES, check_recipe_name, make_recipe

__all__ = ["GPUInfo", "gpu_info", "fp8_support", "clear_cache", "arch_name", "MIN_CAPABILITY", "recipe_support",
           "default_recipe_name", "resolve_recipe"]

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


# Minimum compute capability per recipe (TE's checks; see the module docstring).
MIN_CAPABILITY = {"delayed": (8, 9), "current": (8, 9), "block": (9, 0), "mxfp8": (10, 0)}

# TE's own availability check per recipe (a function of transformer_engine.pytorch).
_TE_CHECK = {"delayed": "is_fp8_available", "current": "is_fp8_available",
             "block": "is_fp8_block_scaling_available", "mxfp8": "is_mxfp8_available"}

# Preference when the caller names no recipe: MXFP8 where the hardware has it (Blackwell),
# else delayed scaling, the fastest per-tensor recipe measured on Hopper (docs/benchmarks.md).
_PREFERENCE = ("mxfp8", "delayed", "current", "block")


def recipe_support(capability: Optional[Tuple[int, int]], device_name: str, arch: str) -> Dict[str, Check]:
    """``{recipe: Check}`` for a device: hardware first, then TE's own checks.

    Args:
        capability: compute capability, None without a CUDA GPU.
        device_name: for the reasons, e.g. ``"NVIDIA A100-SXM4-80GB"``.
        arch: its architecture name, e.g. ``"Ampere"``.
    """
    if capability is None:
        why = (f"no CUDA GPU is visible (torch {torch.__version__}, "
               f"built with CUDA {torch.version.cuda or 'none'})")
        return {r: Check(False, why) for r in RECIPE_NAMES}
    out: Dict[str, Check] = {}
    for r in RECIPE_NAMES:
        need = MIN_CAPABILITY[r]
        if capability < need:
            out[r] = Check(False, f"{device_name} has compute capability {capability[0]}.{capability[1]} "
                                  f"({arch}); recipe {r!r} needs {need[0]}.{need[1]}+")
    te = _te.te_status()
    for r in RECIPE_NAMES:
        if r not in out:
            out[r] = _te.te_check(_TE_CHECK[r]) if te.ok else te
    return out


def default_recipe_name(support: Dict[str, Check]) -> Optional[str]:
    """First preferred recipe among ``support`` (``{name: Check}``), or None if none runs."""
    for name in _PREFERENCE:
        if support.get(name, Check(False)).ok:
            return name
    return None


def resolve_recipe(recipe: Union[None, str, Any], support: Dict[str, Check]) -> Any:
    """A recipe argument (None, a name, or a TE recipe object) -> a TE recipe object that runs here.

    A name (or None) gives the same object at every call, :func:`make_recipe`'s, built once per
    process: ``fp8_context`` resolves its recipe at every step, and building a TE recipe (a
    pydantic dataclass, validated) each time was a tenth of its host time (lever 56). TE's scaling
    state and the graphs' keys follow a recipe's settings, not the object.

    Args:
        recipe: None picks :func:`default_recipe_name`; a name must be supported; a TE recipe
            object is returned as is where any FP8 runs (TE validates it on first use).
        support: ``{name: Check}`` for this device (``detect.gpu_info().recipes``).

    Raises:
        ValueError: an unknown name.
        FP8UnavailableError: a named recipe this device cannot run, or no recipe at all.
    """
    if isinstance(recipe, str):
        check = support[check_recipe_name(recipe)]
        if not check.ok:
            usable = [n for n, c in support.items() if c.ok]
            raise FP8UnavailableError(f"FP8 recipe {recipe!r} cannot run here: {check.reason}. "
                                      f"Recipes this GPU supports: {usable}")
        return _named_recipe(recipe)
    name = default_recipe_name(support)
    if name is None:  # also for a recipe object: no FP8 at all here
        raise FP8UnavailableError(f"FP8 cannot run here: {support['delayed'].reason}")
    return _named_recipe(name) if recipe is None else recipe


@functools.lru_cache(maxsize=None)
def _named_recipe(name: str) -> Any:
    """The TE recipe object a recipe name resolves to in this process (:func:`resolve_recipe`)."""
    return make_recipe(name)


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

    Clears the device description, TE's import status and capability answers, the recipe objects
    built for recipe names, whether fp8vit's Triton kernels and its own cuBLASLt call run, so a TE
    or Triton installed or repaired since then is seen.
    """
    gpu_info.cache_clear()
    _named_recipe.cache_clear()  # built by the TE seen before
    _te.clear_cache()
    triton_support.cache_clear()
    rope_support.cache_clear()
    _te.residual_gemm_support.cache_clear()
