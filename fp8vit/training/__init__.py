"""Training-time pieces around converted models (above the blocks, below the conversion API).

=================  ===================================================================================
``context``        ``fp8_context``: bf16 autocast + TE's FP8 autocast, with a clear fallback
``autocast``       ``set_fp8_autocast``: the model's forward enters that context itself
``detect``         what this GPU runs: capability, FP8 recipes, the default one
``switches``       FP8 per block, activation checkpointing, MLP recompute
``graphs``         ``make_graphed_blocks``: the blocks' forward and backward as CUDA graphs
``distributed``    FSDP2, FP8 primary weights
``checkpoint``     distributed checkpoints (DCP) that a kill during saving does not destroy
``guards``         ``NonFiniteGuard``: skip a step with inf/NaN, repair the amax histories
``diagnostics``    ``diagnose``: per-block FP8 error against a bf16 run
``numerics``       SNR and FP8 range arithmetic
=================  ===================================================================================

Import the public names from ``fp8vit``.
"""
