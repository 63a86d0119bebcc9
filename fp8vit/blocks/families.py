"""The block families: which timm block classes fp8vit replaces by which of its fused blocks.

``convert_to_te`` looks every module's exact class up here (a timm subclass or variant, such as
``vision_transformer.ResPostBlock``, is another family, or none). Adding a family is one entry of
:data:`FAMILIES`: the fp8vit block class and the timm classes it replaces, by import path, so
that this table imports nothing until it is first used.

Contract of an fp8vit block class (checked when the table is first resolved):

* it subclasses :class:`fp8vit.blocks.base.FP8Block`;
* ``cls.from_timm(block, *, exact_gelu=False, backend=None, fp32_residual=False)`` returns the
  fp8vit block with ``block``'s weights, or raises ``ValueError`` saying what it cannot honour;
* ``instance.to_timm()`` returns the timm block.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Dict, Optional, Tuple

from torch import nn

from .base import FP8Block

__all__ = ["Family", "FAMILIES", "block_classes", "fp8vit_block_for", "family_name"]


@dataclasses.dataclass(frozen=True)
class Family:
    """One block family.

    Attributes:
        block: import path of the fp8vit block class, e.g. ``"fp8vit.blocks.vit.TE_Block"``.
        timm_blocks: import paths of the timm block classes it replaces (exact classes).
    """

    block: str
    timm_blocks: Tuple[str, ...]


FAMILIES: Tuple[Family, ...] = (
    Family("fp8vit.blocks.vit.TE_Block", ("timm.models.vision_transformer.Block",)),
    Family("fp8vit.blocks.eva.TE_EvaBlock", ("timm.models.eva.EvaBlock", "timm.models.eva.EvaBlockPostNorm")),
    Family("fp8vit.blocks.beit.TE_BeitBlock", ("timm.models.beit.Block",)),
    Family("fp8vit.blocks.swin.TE_SwinBlock", ("timm.models.swin_transformer.SwinTransformerBlock",)),
    Family("fp8vit.blocks.swin.TE_SwinV2Block", ("timm.models.swin_transformer_v2.SwinTransformerV2Block",)),
    Family("fp8vit.blocks.convnext.TE_ConvNeXtBlock", ("timm.models.convnext.ConvNeXtBlock",)),
)


def _resolve(path: str) -> Optional[type]:
    """The class at ``"package.module.Name"``, or None where the module or the name is missing."""
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


@functools.lru_cache(maxsize=None)
def block_classes() -> Dict[type, type]:
    """``{timm block class: fp8vit block class}`` for the installed timm.

    A timm class this timm does not have is left out (no model of this timm can hold one).

    Raises:
        ImportError: an fp8vit block class that does not import (a broken entry of FAMILIES).
        TypeError: an fp8vit block class that breaks the contract (module docstring), named.
    """
    table: Dict[type, type] = {}
    for fam in FAMILIES:
        cls = _resolve(fam.block)
        if cls is None:
            raise ImportError(f"fp8vit.blocks.families: {fam.block} does not import; fix its entry in FAMILIES")
        missing = [m for m in ("from_timm", "to_timm") if not callable(getattr(cls, m, None))]
        if not (isinstance(cls, type) and issubclass(cls, FP8Block)) or missing:
            raise TypeError(f"fp8vit.blocks.families: {fam.block} must subclass fp8vit.blocks.base.FP8Block and "
                            f"define from_timm and to_timm (missing: {missing})")
        for path in fam.timm_blocks:
            timm_cls = _resolve(path)
            if timm_cls is not None:
                table[timm_cls] = cls
    return table


def fp8vit_block_for(module: nn.Module) -> Optional[type]:
    """The fp8vit block class that replaces ``module``'s exact class, or None."""
    return block_classes().get(type(module))


def family_name(timm_cls: type, fp8vit_cls: type) -> str:
    """``"vision_transformer.Block -> TE_Block"``: how a summary names a family."""
    return f"{timm_cls.__module__.rpartition('.')[2]}.{timm_cls.__qualname__} -> {fp8vit_cls.__name__}"
