"""Lightning: fp8vit as a precision plugin, ``Trainer(plugins=[FP8VitPrecision()])``.

    import lightning as L
    from fp8vit.integrations.lightning import FP8VitPrecision

    trainer = L.Trainer(plugins=[FP8VitPrecision()], max_steps=1000)   # no `precision=` flag
    trainer.fit(lit_module)                                            # lit_module holds a timm ViT

As Lightning's own Transformer Engine plugin: ``convert_module`` converts the module when the
strategy sets it up (before DDP wraps it), ``forward_context`` runs every training, validation,
test and predict step inside ``fp8vit.fp8_context`` (bf16 autocast plus FP8 where the GPU has it;
bf16 with one warning where it does not); ``backward`` runs outside it, as Lightning runs it.

Resuming (``trainer.fit(..., ckpt_path=...)``): Lightning loads the checkpoint's weights before
the strategy's setup, into the module as built, so the module must hold the converted blocks by
then: call ``fp8vit.convert_to_te`` in the LightningModule's ``configure_model`` (or ``__init__``);
the plugin then finds them converted. A module left to the plugin raises, on resume, Lightning's
"Missing key(s) in state_dict" naming fp8vit's parameter names.
"""

from __future__ import annotations

from typing import Any, ContextManager

import torch
from lightning.pytorch.plugins.precision import Precision

import fp8vit

__all__ = ["FP8VitPrecision"]


class FP8VitPrecision(Precision):
    """Lightning precision plugin: fp8vit's FP8 blocks, stepped in ``fp8vit.fp8_context``.

    Args:
        recipe: the FP8 recipe, as ``fp8_context``'s: None (the GPU's best, bf16 with a warning
            where FP8 cannot run), a name (``"delayed"``, ``"current"``, ``"block"``, ``"mxfp8"``:
            raises where it cannot run) or a TE recipe object.
        amax_reduction_group: as ``fp8_context``'s (None: all ranks, right for DDP).
        cuda_graphs: the blocks of every ViT in the module run as CUDA graphs, each batch shape
            captured as it comes (``convert_to_te(cuda_graphs=True)``): the fast path, eager FP8
            being host-bound below ViT-H (ViT-B/16 0.91x bf16 eager). False for strategies that
            shard the blocks (FSDP), which graphs cannot hold.

    The plugin converts with ``convert_to_te``'s defaults otherwise; for its options
    (``exact_gelu``, ``fallback``, ...) convert in ``configure_model``, as for resuming.

    Raises:
        TypeError, ValueError: at the call, a bad argument, as ``fp8_context`` refuses it
            (``cuda_graphs`` not a bool).
    """

    precision = "bf16-mixed"  # what the steps run in outside the FP8 GEMMs

    def __init__(self, recipe: Any = None, *, amax_reduction_group: Any = None, cuda_graphs: bool = True) -> None:
        fp8vit.fp8_context(recipe, amax_reduction_group=amax_reduction_group)  # checks them now (not entered)
        if not isinstance(cuda_graphs, bool):
            raise TypeError(f"FP8VitPrecision(cuda_graphs=...): expected True or False, got {cuda_graphs!r} "
                            f"({type(cuda_graphs).__name__})")
        self.recipe = recipe
        self.amax_reduction_group = amax_reduction_group
        self.cuda_graphs = cuda_graphs

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Convert ``module``'s timm blocks in place (Lightning's DDP strategy ignores the return);
        blocks already converted stay as they are; with ``cuda_graphs``, graph the ViTs inside."""
        fp8vit.convert_to_te(module, cuda_graphs=self.cuda_graphs)
        return module

    def forward_context(self) -> ContextManager:
        return fp8vit.fp8_context(self.recipe, amax_reduction_group=self.amax_reduction_group)
