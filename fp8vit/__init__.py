"""fp8vit: FP8 training of timm Vision Transformers on NVIDIA Transformer Engine.

    model = timm.create_model("vit_base_patch16_224").cuda()
    fp8vit.convert_to_te(model)                   # or VisionTransformer(block_fn=fp8vit.TE_Block)
    print(fp8vit.conversion_summary(model))       # what was fused, swapped to FP8 Linears, kept
    fp8vit.make_graphed_blocks(model, batch_size=128)   # optional: CUDA graphs (below ViT-H)
    # or, on several GPUs without graphs: fp8vit.shard_model(model)  (FSDP2 per block)
    with fp8vit.fp8_context():                    # bf16 autocast + TE FP8 where the GPU has it
        loss = criterion(model(images), labels)
    loss.backward()
    # or carry FP8 in the model and keep the loop unchanged: fp8vit.convert_to_te(model, autocast=True)

``import fp8vit`` never requires TE or a GPU. If TE is installed and a GPU is visible, it is
imported here, before any cuDNN kernel runs (a later import can load a clashing cuDNN).
The command-line tools (``fp8vit-bench``, ``fp8vit-profile``, ``fp8vit-diagnose``) live in
``fp8vit.tools``, which the library itself never imports.
"""

from importlib.metadata import PackageNotFoundError, version

from . import _moved, _te
from .blocks.backend import set_bias_grad_kernel, set_cudnn_layernorm, set_norm_grad_add, set_residual_gemm
from .blocks.vit import TE_Block
from .blocks.config import BlockConfig
from .training.context import FP8State, fp8_context
from .training.autocast import set_fp8_autocast
from .convert import FALLBACKS, convert_from_te, convert_to_te
from .training.switches import set_block_fp8, set_grad_checkpointing, set_mlp_recompute, set_patch_gemm
from .training.detect import GPUInfo, fp8_support, gpu_info
from .training.diagnostics import BlockStats, DiagnosisReport, diagnose
from .training.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .training.distributed import default_mp_policy, fp8_weight_init, fp8_weight_optimizer, shard_model
from .errors import Check, ConversionError, FP8UnavailableError, TEUnavailableError
from .blocks.beit import TE_BeitBlock
from .blocks.eva import TE_EvaBlock
from .blocks.swin import TE_SwinBlock, TE_SwinV2Block
from .blocks.convnext import TE_ConvNeXtBlock
from .training.graphs import GraphedBlocks, make_graphed_blocks
from .training.guards import NonFiniteEvent, NonFiniteGuard
from .training.numerics import snr_db
from ._te.recipes import RECIPE_NAMES, RecipeName, make_recipe
from .summary import ConversionSummary, conversion_summary

try:
    __version__ = version("fp8vit")  # one source of truth: pyproject.toml
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    # blocks and model conversion
    "TE_Block",
    "BlockConfig",
    "TE_EvaBlock",
    "TE_BeitBlock",
    "TE_SwinBlock",
    "TE_SwinV2Block",
    "TE_ConvNeXtBlock",
    "convert_to_te",
    "convert_from_te",
    "FALLBACKS",
    "conversion_summary",
    "ConversionSummary",
    "set_grad_checkpointing",
    "set_mlp_recompute",
    "set_patch_gemm",
    "set_block_fp8",
    # FP8 execution
    "fp8_context",
    "FP8State",
    "set_fp8_autocast",
    "RecipeName",
    "RECIPE_NAMES",
    "make_recipe",
    "make_graphed_blocks",
    "GraphedBlocks",
    "set_cudnn_layernorm",
    "set_bias_grad_kernel",
    "set_residual_gemm",
    "set_norm_grad_add",
    # several GPUs: FSDP2, FP8 primary weights, distributed checkpoints
    "shard_model",
    "default_mp_policy",
    "fp8_weight_init",
    "fp8_weight_optimizer",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    # FP8 safety
    "diagnose",
    "DiagnosisReport",
    "BlockStats",
    "snr_db",
    "NonFiniteGuard",
    "NonFiniteEvent",
    # capability detection
    "fp8_support",
    "gpu_info",
    "GPUInfo",
    "Check",
    # errors
    "TEUnavailableError",
    "FP8UnavailableError",
    "ConversionError",
]

_te.preload()
_moved.install()
