"""FP8 recipes: their names, what each needs, name <-> TE recipe object, the default per GPU.

=========  ==============================  ===============================================
name       TE recipe                       needs
=========  ==============================  ===============================================
delayed    DelayedScaling (HYBRID)         sm_89 (Ada) or sm_90+; per-tensor scales from
                                           an amax history; stateful (checkpointed)
current    Float8CurrentScaling (HYBRID)   sm_89+; per-tensor scales from this step's amax
block      Float8BlockScaling              sm_90+ (Hopper); 1x128 / 128x128 block scales
mxfp8      MXFP8BlockScaling               sm_100+ (Blackwell); 1x32 E8M0 block scales
=========  ==============================  ===============================================

Names are validated here before TE is loaded, so a typo is a ``ValueError`` on every machine.
Whether a recipe runs is decided first by the compute capability, then by TE's own check
(``_te.te_check``); the table above is what fp8vit reports when TE is not there to ask.
"""

from __future__ import annotations

import enum
from typing import Any, Dict, Optional, Tuple, Union

import torch

from . import _te
from ._validate import check_choice, show
from .errors import Check, FP8UnavailableError

__all__ = ["RecipeName", "RECIPE_NAMES", "MIN_CAPABILITY", "check_recipe_name", "check_recipe", "make_recipe",
           "recipe_name", "recipe_support", "default_recipe_name", "resolve_recipe", "row_multiple"]


class RecipeName(str, enum.Enum):
    """The FP8 recipes fp8vit knows by name (a ``str``: ``RecipeName.DELAYED == "delayed"``)."""

    DELAYED = "delayed"
    CURRENT = "current"
    BLOCK = "block"
    MXFP8 = "mxfp8"


RECIPE_NAMES: Tuple[str, ...] = tuple(r.value for r in RecipeName)

# Minimum compute capability per recipe (TE's checks; see the module docstring).
MIN_CAPABILITY = {"delayed": (8, 9), "current": (8, 9), "block": (9, 0), "mxfp8": (10, 0)}

# TE's own availability check per recipe (a function of transformer_engine.pytorch).
_TE_CHECK = {"delayed": "is_fp8_available", "current": "is_fp8_available",
             "block": "is_fp8_block_scaling_available", "mxfp8": "is_mxfp8_available"}

# Preference when the caller names no recipe: MXFP8 where the hardware has it (Blackwell),
# else delayed scaling, the fastest per-tensor recipe measured on Hopper (docs/benchmarks.md).
_PREFERENCE = ("mxfp8", "delayed", "current", "block")

# recipe_name() probes TE recipe objects with these predicates.
_PREDICATE = {"delayed": "delayed", "current": "float8_current_scaling", "block": "float8_block_scaling",
              "mxfp8": "mxfp8"}


_OR_OBJECT = ", None (the default) or a transformer_engine.common.recipe object"


def check_recipe_name(name: str, fn: str = "check_recipe_name", arg: str = "name") -> str:
    """Return ``name`` as a plain string if it is a known recipe name, else raise.

    Args:
        name: the name to check.
        fn, arg: the public entry and its argument, to name in the error; for an argument named
            ``recipe`` the error also lists what else such an argument takes (:func:`check_recipe`).

    Raises:
        TypeError: ``name`` is not a str.
        ValueError: an unknown name, listing the known ones. TE is not needed for this check.
    """
    check_choice(fn, arg, name, RECIPE_NAMES, also=_OR_OBJECT if arg == "recipe" else "")
    return RecipeName(name).value


def check_recipe(fn: str, recipe: Any, arg: str = "recipe") -> Any:
    """``recipe`` if it is what a ``recipe`` argument takes: None, a name in :data:`RECIPE_NAMES`, or a
    TE recipe object (recognised, without TE, by the predicates :func:`recipe_name` asks).

    Raises:
        TypeError: anything else (``recipe=3``, ``recipe=True``).
        ValueError: an unknown name.
    """
    if recipe is None:
        return recipe
    if isinstance(recipe, str):
        check_recipe_name(recipe, fn, arg)
    elif not any(callable(getattr(recipe, pred, None)) for pred in _PREDICATE.values()):
        raise TypeError(f"{fn}({arg}={show(recipe)}): expected one of {list(RECIPE_NAMES)}, None or "
                        f"a transformer_engine.common.recipe object, got {type(recipe).__name__}")
    return recipe


def make_recipe(name: str) -> Any:
    """Build the TE recipe object for ``name`` (TE's defaults, HYBRID format: E4M3 fwd, E5M2 bwd).

    Args:
        name: one of :data:`RECIPE_NAMES`.

    Raises:
        TypeError: ``name`` is not a str.
        ValueError: an unknown name (checked before TE is loaded).
        TEUnavailableError: TE cannot be imported; the message says why.
    """
    name = check_recipe_name(name, "make_recipe")
    rec = _te.recipe_module()
    if name == "delayed":
        return rec.DelayedScaling(fp8_format=rec.Format.HYBRID)
    if name == "current":
        return rec.Float8CurrentScaling(fp8_format=rec.Format.HYBRID)
    if name == "block":
        return rec.Float8BlockScaling()
    return rec.MXFP8BlockScaling()


def recipe_name(recipe: Any) -> str:
    """Inverse of :func:`make_recipe` for any TE recipe object (``"custom"`` when unknown)."""
    for name, pred in _PREDICATE.items():
        fn = getattr(recipe, pred, None)
        if fn is not None and fn():
            return name
    return "custom"


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
        return make_recipe(recipe)
    name = default_recipe_name(support)
    if name is None:  # also for a recipe object: no FP8 at all here
        raise FP8UnavailableError(f"FP8 cannot run here: {support['delayed'].reason}")
    return make_recipe(name) if recipe is None else recipe


def row_multiple(name: Optional[str]) -> int:
    """How many token rows (batch x tokens) an FP8 GEMM of the recipe named ``name`` (as
    :func:`recipe_name` gives it; None: FP8 off) needs as a multiple.

    TE's own check asks for a multiple of 8, but the weight-gradient GEMM reduces over the token
    rows and cuBLASLt then asserts ``lda % 16 == 0`` (measured on H200: 8 x 65 = 520 rows passes
    TE's check and fails in backward). MXFP8 scales blocks of 32 along both dims.
    """
    if name is None:
        return 1
    return 32 if name == "mxfp8" else 16
