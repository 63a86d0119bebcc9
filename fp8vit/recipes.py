"""FP8 recipe names, their hardware requirements, and name -> TE recipe object.

=========  ==============================  ===============================================
name       TE recipe                       needs
=========  ==============================  ===============================================
delayed    DelayedScaling (HYBRID)         sm_89 (Ada) or sm_90+; per-tensor scales from
                                           an amax history; stateful (checkpointed)
current    Float8CurrentScaling (HYBRID)   sm_89+; per-tensor scales from this step's amax
block      Float8BlockScaling              sm_90+ (Hopper); 1x128 / 128x128 block scales
mxfp8      MXFP8BlockScaling               sm_100+ (Blackwell); 1x32 E8M0 block scales
=========  ==============================  ===============================================

What a given machine supports is asked from TE itself (``_te.recipe_checks``); the table is
what fp8vit reports when TE is not there to ask.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

__all__ = ["RECIPE_NAMES", "MIN_CAPABILITY", "check_recipe_name", "make_recipe", "recipe_name", "default_recipe_name",
           "row_multiple"]

RECIPE_NAMES: Tuple[str, ...] = ("delayed", "current", "block", "mxfp8")

# Minimum compute capability per recipe (from TE's checks; see module docstring).
MIN_CAPABILITY = {"delayed": (8, 9), "current": (8, 9), "block": (9, 0), "mxfp8": (10, 0)}

# Preference when the caller names no recipe: MXFP8 where the hardware has it (Blackwell),
# else delayed scaling, the fastest per-tensor recipe measured on Hopper (docs/benchmarks.md).
_PREFERENCE = ("mxfp8", "delayed", "current", "block")


def check_recipe_name(name: str) -> str:
    """Return ``name`` if it is a known recipe name, else raise ValueError listing them."""
    if name not in RECIPE_NAMES:
        raise ValueError(f"unknown FP8 recipe {name!r}; choose one of {list(RECIPE_NAMES)} "
                         "or pass a transformer_engine.common.recipe object")
    return name


def make_recipe(name: str) -> Any:
    """Build the TE recipe object for ``name`` (TE's defaults, HYBRID format: E4M3 fwd, E5M2 bwd).

    Args:
        name: one of :data:`RECIPE_NAMES`.
    """
    from . import _te

    rec = _te.recipe_module()
    check_recipe_name(name)
    if name == "delayed":
        return rec.DelayedScaling(fp8_format=rec.Format.HYBRID)
    if name == "current":
        return rec.Float8CurrentScaling(fp8_format=rec.Format.HYBRID)
    if name == "block":
        return rec.Float8BlockScaling()
    return rec.MXFP8BlockScaling()


def recipe_name(recipe: Any) -> str:
    """Inverse of :func:`make_recipe` for any TE recipe object (``"custom"`` when unknown)."""
    for name, pred in (("delayed", "delayed"), ("current", "float8_current_scaling"),
                       ("block", "float8_block_scaling"), ("mxfp8", "mxfp8")):
        fn = getattr(recipe, pred, None)
        if fn is not None and fn():
            return name
    return "custom"


def default_recipe_name(available: dict) -> Optional[str]:
    """First preferred recipe among ``available`` (``{name: (ok, reason)}``), or None."""
    for name in _PREFERENCE:
        if available.get(name, (False, ""))[0]:
            return name
    return None


def row_multiple(recipe: Any) -> int:
    """How many token rows (batch x tokens) an FP8 GEMM of ``recipe`` needs as a multiple.

    TE's own check asks for a multiple of 8, but the weight-gradient GEMM reduces over the token
    rows and cuBLASLt then asserts ``lda % 16 == 0`` (measured on H200: 8 x 65 = 520 rows passes
    TE's check and fails in backward). MXFP8 scales blocks of 32 along both dims.
    """
    if recipe is None:
        return 1
    return 32 if recipe_name(recipe) == "mxfp8" else 16
