"""fp8vit: FP8 training of timm Vision Transformers on NVIDIA Transformer Engine.

    model = timm.create_model("vit_base_patch16_224")
    fp8vit.convert_to_te(model.cuda())            # or VisionTransformer(block_fn=fp8vit.TE_Block)
    with fp8vit.fp8_context():                    # bf16 autocast + TE FP8 where the GPU has it
        loss = criterion(model(images), labels)
    loss.backward()

``import fp8vit`` never requires TE or a GPU. If TE is installed and a GPU is visible, it is
imported here, before any cuDNN kernel runs (a later import can load a clashing cuDNN).
"""

from . import _te
from .block import TE_Block
from .config import BlockConfig
from .context import FP8State, fp8_context
from .convert import convert_from_te, convert_to_te, set_grad_checkpointing
from .detect import GPUInfo, fp8_support, gpu_info
from .diagnostics import BlockStats, DiagnosisReport, diagnose, set_block_fp8
from .guards import NonFiniteEvent, NonFiniteGuard
from .errors import ConversionError, FP8UnavailableError, TEUnavailableError
from .recipes import RECIPE_NAMES, make_recipe

__version__ = "0.1.0"

__all__ = [
    # blocks and model conversion
    "TE_Block",
    "BlockConfig",
    "convert_to_te",
    "convert_from_te",
    "set_grad_checkpointing",
    # FP8 execution
    "fp8_context",
    "FP8State",
    "RECIPE_NAMES",
    "make_recipe",
    # FP8 safety
    "diagnose",
    "DiagnosisReport",
    "BlockStats",
    "set_block_fp8",
    "NonFiniteGuard",
    "NonFiniteEvent",
    # capability detection
    "fp8_support",
    "gpu_info",
    "GPUInfo",
    # errors
    "TEUnavailableError",
    "FP8UnavailableError",
    "ConversionError",
]

_te.preload()
