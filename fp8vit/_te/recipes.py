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
Which recipes run on this GPU is :mod:`fp8vit.training.detect`'s question.
"""

from __future__ import annotations

import copy
import enum
from typing import Any, Optional, Tuple

from .._validate import check_bool, check_choice, show
from .loader import te_module, te_version

__all__ = ["RecipeName", "RECIPE_NAMES", "check_recipe_name", "check_recipe", "make_recipe", "recipe_name",
           "row_multiple", "recipe_settings", "fast_backward_accumulation"]


class RecipeName(str, enum.Enum):
    """The FP8 recipes fp8vit knows by name (a ``str``: ``RecipeName.DELAYED == "delayed"``)."""

    DELAYED = "delayed"
    CURRENT = "current"
    BLOCK = "block"
    MXFP8 = "mxfp8"


RECIPE_NAMES: Tuple[str, ...] = tuple(r.value for r in RecipeName)

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


def make_recipe(name: str, *, fp8_attention: bool = False) -> Any:
    """Build the TE recipe object for ``name`` (TE's defaults, HYBRID format: E4M3 fwd, E5M2 bwd),
    except that ``"delayed"``'s input-gradient GEMMs use fast accumulation (:func:`fast_backward_accumulation`
    with ``wgrad=False``): on an H100, batch 128, graphed steps 1% faster (ViT-B/16 29.3 to 29.0 ms,
    ViT-L/16 84.3 to 83.5 ms), every SNR against bf16 within 0.05 dB of TE's split accumulator at
    ViT-B and ViT-L (docs/performance.md, lever 53).

    Args:
        name: one of :data:`RECIPE_NAMES`.
        fp8_attention: also run the attention's two matmuls in FP8 (TE's ``fp8_dpa``, a beta
            feature of TE: cuDNN's FP8 attention). Refused on Hopper with TE up to 2.20 (below);
            elsewhere unmeasured: check its numerics (SNR against bf16, the GPU suite's
            ``test_fp8_attention_snr_vs_bf16``) before relying on it. Not with ``"block"``, which
            TE refuses it for.

    Raises:
        TypeError: ``name`` is not a str, ``fp8_attention`` not a bool.
        ValueError: an unknown name, ``fp8_attention`` with ``"block"`` (checked before TE is loaded),
            or ``fp8_attention`` on a Hopper GPU (compute capability 9.x) with TE <= 2.20: there
            (H200, TE 2.20.2, cuDNN 9.19) TE has FP8 attention kernels for head dim 128 only, with
            delayed scaling they gave logits 1.1 dB from bf16's (noise, not FP8 rounding:
            docs/results/tests/gpu_test_fp8_gpu_h200.log), and current scaling has none before
            compute capability 10.0.
        TEUnavailableError: TE cannot be imported; the message says why.
    """
    name = check_recipe_name(name, "make_recipe")
    check_bool("make_recipe", "fp8_attention", fp8_attention)
    if fp8_attention and name == "block":
        raise ValueError("make_recipe('block', fp8_attention=True): TE's block scaling recipe has no FP8 "
                         "attention; use 'delayed', 'current' or 'mxfp8'")
    if fp8_attention:
        _check_fp8_attention(name)
    rec = te_module("transformer_engine.common.recipe")
    dpa = {"fp8_dpa": True} if fp8_attention else {}
    if name == "delayed":
        # a fresh object: set in place, no copy
        return _set_backward_accumulation(rec.DelayedScaling(fp8_format=rec.Format.HYBRID, **dpa), rec.MMParams,
                                          dgrad=True, wgrad=False)
    if name == "current":
        return rec.Float8CurrentScaling(fp8_format=rec.Format.HYBRID, **dpa)
    if name == "block":
        return rec.Float8BlockScaling()
    return rec.MXFP8BlockScaling(**dpa)


def fast_backward_accumulation(recipe: Any, *, dgrad: bool = True, wgrad: bool = True) -> Any:
    """A copy of the TE recipe object ``recipe`` that sets how its backward FP8 GEMMs accumulate:
    ``dgrad`` (the input gradient's) and ``wgrad`` (the weights'), each True for the tensor cores
    alone (cuBLASLt's fast accumulation, as TE's forward GEMMs do), False for TE's split accumulator
    (partial sums promoted to fp32 as K runs; TE's default). :func:`make_recipe` uses it for delayed
    scaling's fast input gradients; lever 53's bench variants (``-fastacc-``, ``-fastdgrad-``,
    ``-splitacc-``) for their A/Bs.

    TE 2.20's Linear, LayerNormLinear and LayerNormMLP take the choice from the recipe's
    ``fp8_gemm_dgrad`` / ``fp8_gemm_wgrad`` ``MMParams`` where it has them (current and block
    scaling do) and from their module constants otherwise (delayed scaling): the copy gets both,
    so what it says does not depend on the recipe it came from. The forward's setting is left as
    it is.

    Raises:
        ValueError: a block-scaling recipe, for which TE requires the split accumulator.
    """
    if recipe_name(recipe) == "block":
        raise ValueError("fast_backward_accumulation: TE's Float8BlockScaling requires split accumulators in "
                         "every GEMM (its own check); use it with 'delayed' or 'current'")
    return _set_backward_accumulation(copy.copy(recipe), te_module("transformer_engine.common.recipe").MMParams,
                                      dgrad=dgrad, wgrad=wgrad)


def _set_backward_accumulation(recipe: Any, mm_params: type, *, dgrad: bool, wgrad: bool) -> Any:
    """``recipe`` itself with its backward GEMMs' ``MMParams`` set (see :func:`fast_backward_accumulation`)."""
    for gemm, fast in (("fp8_gemm_dgrad", dgrad), ("fp8_gemm_wgrad", wgrad)):
        # DelayedScaling declares no such field: an instance attribute, as TE's hasattr finds it
        setattr(recipe, gemm, mm_params(use_split_accumulator=not fast))
    return recipe


# The last TE release whose FP8 attention was measured unusable on Hopper (see make_recipe)
_FP8_ATTENTION_BROKEN_UP_TO = "2.20"


def _check_fp8_attention(name: str) -> None:
    """Refuse ``fp8_attention`` where it was measured to give noise: Hopper with TE <= 2.20."""
    import torch
    from packaging.version import Version

    if not torch.cuda.is_available():
        return
    cap = torch.cuda.get_device_capability()
    ver = te_version()
    if cap[0] != 9 or ver is None or Version(Version(ver).base_version).release[:2] > Version(_FP8_ATTENTION_BROKEN_UP_TO).release:
        return
    why = ("with delayed scaling its logits were 1.1 dB from bf16's on the H200 (noise, not FP8 rounding: "
           "docs/results/tests/gpu_test_fp8_gpu_h200.log)" if name == "delayed" else
           f"TE has no FP8 attention kernel for recipe {name!r} before compute capability 10.0")
    raise ValueError(f"make_recipe({name!r}, fp8_attention=True): refused on this GPU (compute capability "
                     f"{cap[0]}.{cap[1]}, Hopper) with Transformer Engine {ver}: {why}. Use "
                     f"make_recipe({name!r}) (attention in bf16, as by default: the GEMMs stay FP8)")


def recipe_name(recipe: Any) -> str:
    """Inverse of :func:`make_recipe` for any TE recipe object (``"custom"`` when unknown)."""
    for name, pred in _PREDICATE.items():
        fn = getattr(recipe, pred, None)
        if fn is not None and fn():
            return name
    return "custom"


def recipe_settings(recipe: Any) -> Tuple[Tuple[str, Any], ...]:
    """``(attribute, value)`` pairs, sorted, of a TE recipe object beyond its name: margin, format,
    amax history and algorithms, FP8 attention, the GEMMs' accumulation (set fields and those
    :func:`fast_backward_accumulation` adds alike: the instance's own attributes). A CUDA graph
    bakes some of them in (the FP8 formats, FP8 attention, the GEMMs' accumulation: kernels and
    their arguments), so graphs captured under one recipe are not replayed for a recipe of the same
    name with other settings; keying on all of them needs no list of which. Unhashable values are
    compared by their repr.
    """
    out = []
    for name, value in sorted(vars(recipe).items()):
        if name.startswith("_"):
            continue
        try:
            hash(value)
        except TypeError:
            value = repr(value)
        out.append((name, value))
    return tuple(out)


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
