"""TE modules that keep delayed scaling alive across a switch of recipe kind (delayed -> current,
block or MXFP8 -> delayed again).

TE 2.20 (``module/base.py`` ``init_fp8_metadata`` -> ``set_meta_tensor``; ``quantization.py``):
when a module meets a recipe of another kind it builds a fresh recipe state, and a fresh
delayed-scaling state starts at scale 1.0 with an empty amax history (nothing is inherited across
kinds). TE enters a module's delayed-scaling tensors into its process-wide amax/scale buffers only
while ``fp8_meta`` has no ``"buffer_index_and_autocast_key"``, and that key stays from the module's
first delayed step: the fresh tensors are never entered, so nothing updates their scale, which
stays 1.0 for good (and E5M2 gradients of small magnitude underflow at that scale).
:class:`RecipeSwitchFix` forgets the key when a delayed recipe meets a state of another kind, so
TE enters the fresh state as it does for a new module.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

from .fp8 import active_fp8_recipe
from .loader import te_module

__all__ = ["RecipeSwitchFix", "BUFFER_KEY"]

# fp8_meta's record of the module's place in TE's process-wide delayed-scaling buffers (TE 2.x:
# ``FP8GlobalStateManager.get_buffer_info()``)
BUFFER_KEY = "buffer_index_and_autocast_key"


@functools.lru_cache(maxsize=None)
def _delayed_state_type() -> Optional[type]:
    return getattr(te_module("transformer_engine.pytorch.quantization"), "DelayedScalingRecipeState", None)


class RecipeSwitchFix:
    """Mixin for TE modules (before the TE class in the bases): see the module docstring.

    The check runs where TE sets a module up for each forward (``init_fp8_metadata``); while the
    module's state already is delayed scaling's, or it never ran delayed scaling, it costs one dict
    lookup.
    """

    def init_fp8_metadata(self, *args: Any, **kwargs: Any):
        meta = getattr(self, "fp8_meta", None)  # set by TE's __init__; read defensively all the same
        if isinstance(meta, dict) and BUFFER_KEY in meta:
            state, delayed = meta.get("scaling_fwd"), _delayed_state_type()
            if state is not None and delayed is not None and not isinstance(state, delayed):
                recipe = active_fp8_recipe()
                if recipe is not None and recipe.delayed():
                    del meta[BUFFER_KEY]
        return super().init_fp8_metadata(*args, **kwargs)
