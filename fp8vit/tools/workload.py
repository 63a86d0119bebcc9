"""The training workload shared by ``fp8vit-bench``, ``fp8vit-profile`` and ``fp8vit-diagnose``.

A timm ViT (any timm name, or the sizes below), random init, synthetic data, one variant.
A variant's name says what runs the blocks, in which precision, and how:

=================================  ===========================================================
``timm-bf16``                      timm's blocks, bf16 autocast (the baseline)
``timm-bf16-compile``              the same, ``torch.compile``d
``torchao-fp8-compile``            torchao float8 (tensorwise) on the blocks' Linears, compiled
``te-layer-fp8[-graphed]``         a plain ``te.TransformerLayer`` configured for a ViT (bshd, no
                                   mask, eps 1e-6): the raw-TE speed reference, FP8 delayed
``fp8vit-bf16[-graphed]``          fp8vit ``TE_Block``s, bf16 autocast, FP8 off
``fp8vit-fp8-RECIPE[-graphed]``    fp8vit ``TE_Block``s in ``fp8_context(RECIPE)``
``fp8vit-fp8-RECIPE-cudnn-norm[-graphed]``  the same with :func:`fp8vit.set_cudnn_layernorm` on
``fp8vit-fp8-RECIPE-linear``       ``convert_to_te(fallback="linear")``: blocks fp8vit has no fused
                                   block for (Swin, CaiT, ...) get FP8 Linears (the generic path);
                                   on a model of fused blocks only, the same as without ``-linear``
``fp8vit-fp8-delayed-linear-compile``  the same, then ``torch.compile`` of the whole model (each
                                   FP8 Linear a graph break, the rest compiled)
``fp8vit-fp8-delayed-blockcompile[-graphed]``  ``convert_to_te(fallback="compile")``: the blocks
                                   fp8vit cannot fuse are ``torch.compile``d (a Sequential of them
                                   as one; the fused blocks are not; ``-graphed`` captures those)
``fp8vit-fp8-delayed[-graphed]-compile``  ``convert_to_te(model)`` then ``torch.compile`` of the whole
                                   model: everything but the fused blocks (which run outside dynamo,
                                   as TE kernels or, ``-graphed``, CUDA graphs) is compiled
``fp8vit-fp8-delayed-fp8attn[-graphed]``  the attention's matmuls in FP8 too
                                   (``make_recipe("delayed", fp8_attention=True)``: TE's ``fp8_dpa``)
``fp8vit-fp8-delayed-{torch,te}bias-graphed[-compile]``  attention with a learned bias (BEiT, Swin)
                                   by torch's SDPA or by TE's, whatever the family's default (the
                                   blocks' ``bias_attention``: Swin "torch", BEiT "te")
``fp8vit-fp8-delayed-bf16narrow-graphed[-compile]``  FP8 off (``set_block_fp8``) in the fused
                                   blocks narrower than :data:`NARROW` channels (Swin's and
                                   ConvNeXt's first two stages), whose skinny GEMMs gain less than
                                   their FP8 casts cost
``fp8vit-fp8-delayed-convpatch-graphed[-compile]``  the patch embedding left a convolution
                                   (``convert_to_te(patch_gemm=False)``; every other fp8vit
                                   variant runs it as one GEMM, :func:`fp8vit.set_patch_gemm`)
``fp8vit-fp8-delayed-terope[-graphed]``  RoPE blocks rotate q and k with TE's kernel
                                   (``TE_EvaBlock.rope_kernel = "te"``; the default is the Triton
                                   pass over the packed QKV buffer where it runs)
``fp8vit-fp8-delayed-torchnorm[-graphed]``  the model's own LayerNorms (final ``norm``, ...) left
                                   torch's under autocast (``convert_to_te`` runs them as one
                                   Triton pass each way: ``fp8vit.blocks.model_norm``)
``timm-bf16-nchw-compile``,        compiled with Inductor's ``layout_optimization`` off: the
``fp8vit-fp8-delayed-nchw-graphed-compile``  convolutions keep the model's own layout (NCHW, as
                                   eager runs them) instead of Inductor's channels-last (the
                                   depthwise convs of ViTamin's conv stages: lever 46)
``fp8vit-fp8-delayed-tedbias-graphed``  the graphs capture TE's own FP8 cast, transpose and bias
                                   gradient of each output gradient, not fp8vit's kernel
                                   (``make_graphed_blocks(triton_dbias=False)``: lever 49)
``fp8vit-fp8-delayed-fastacc-graphed``  the backward's FP8 GEMMs (input and weight gradients)
                                   with fast accumulation, not TE's split accumulator
                                   (``fast_backward_accumulation``: lever 53); ``-fastdgrad-``:
                                   the input gradients' only (``make_recipe("delayed")``'s
                                   default); ``-splitacc[-graphed]``: neither (TE's own default)
``fp8vit-fp8-delayed-blocksgraph-graphed``  the blocks alone in the graphs, not the ViT's stem and
                                   final norm with them (``make_graphed_blocks(stem=False)``:
                                   lever 55 off; ``-blocksgraph-graphed-compile`` compiled, as
                                   ``convert_to_te(compile=True)`` before lever 65)
``fp8vit-fp8-delayed-torchadd-graphed``  the residual adds after TE's GEMMs, by torch, not in the
                                   GEMMs' epilogue (``make_graphed_blocks(residual_gemm=False)``:
                                   lever 61 off, and lever 62 with it)
``fp8vit-fp8-delayed-tegradadd-graphed``  the residual stream's two gradients summed by autograd
                                   after TE's LayerNorm backward, not in it
                                   (``make_graphed_blocks(norm_grad_add=False)``: lever 70 off)
``fp8vit-fp8-delayed-heuristic-graphed``  fp8vit's GEMMs (the residual ones, the input gradients)
                                   on the algorithm cuBLASLt's heuristic puts first, as TE's,
                                   not the fastest of its first eight (lever 62 off)
=================================  ===========================================================

``-graphed`` captures the blocks with :func:`fp8vit.make_graphed_blocks` and its default LayerNorm
kernels (``-cudnn-norm-graphed``: ``cudnn_layernorm=True``). Building a workload sets the
process-wide LayerNorm kernel choice for what it runs eagerly: cuDNN for an eager ``-cudnn-norm``
variant, else TE's own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from .. import _te
from ..blocks.backend import set_cudnn_layernorm
from ..training.context import fp8_context
from ..convert import convert_to_te
from ..training.switches import set_block_fp8, set_mlp_recompute
from ..training.graphs import GraphedBlocks, branch_blocks, graphed_handles, install_graphs, make_graphed_blocks
from ..blocks.base import FP8Block
from ..blocks.linear import is_block
from ..blocks.model_norm import set_model_norms
from .._te.recipes import RECIPE_NAMES, fast_backward_accumulation, make_recipe

__all__ = ["SIZES", "VARIANTS", "Variant", "Workload", "build_workload", "make_optimizer", "train_step_fn",
           "synthetic_batch", "train_flops", "te_layer_block_fn", "ModelShape", "model_shape"]

# ViT sizes by short name: (embed_dim, depth, num_heads). Patch 16, 224 px.
SIZES = {
    "tiny": (192, 12, 3), "small": (384, 12, 6), "base": (768, 12, 12),
    "large": (1024, 24, 16), "huge": (1280, 32, 16),
    "micro": (64, 2, 4),  # CPU smoke tests
}

VARIANTS = (
    "timm-bf16", "timm-bf16-compile", "torchao-fp8-compile", "te-layer-fp8", "te-layer-fp8-graphed",
    "fp8vit-bf16", "fp8vit-bf16-graphed",
    *(f"fp8vit-fp8-{r}" for r in RECIPE_NAMES), *(f"fp8vit-fp8-{r}-graphed" for r in RECIPE_NAMES),
    *(f"fp8vit-fp8-{r}-cudnn-norm{g}" for g in ("", "-graphed") for r in RECIPE_NAMES),
    "fp8vit-fp8-delayed-linear", "fp8vit-fp8-current-linear", "fp8vit-fp8-delayed-linear-compile",
    "fp8vit-fp8-delayed-blockcompile", "fp8vit-fp8-delayed-blockcompile-graphed",
    "fp8vit-fp8-delayed-compile", "fp8vit-fp8-delayed-graphed-compile",
    "fp8vit-fp8-delayed-fp8attn", "fp8vit-fp8-delayed-fp8attn-graphed",
    *(f"fp8vit-fp8-delayed-{k}bias-graphed{c}" for k in ("torch", "te") for c in ("", "-compile")),
    "fp8vit-fp8-delayed-bf16narrow-graphed", "fp8vit-fp8-delayed-bf16narrow-graphed-compile",
    "fp8vit-fp8-delayed-convpatch-graphed", "fp8vit-fp8-delayed-convpatch-graphed-compile",
    "fp8vit-fp8-delayed-terope", "fp8vit-fp8-delayed-terope-graphed",
    "fp8vit-fp8-delayed-torchnorm", "fp8vit-fp8-delayed-torchnorm-graphed",
    "timm-bf16-nchw-compile", "fp8vit-fp8-delayed-nchw-graphed-compile",
    "fp8vit-fp8-delayed-tedbias-graphed", "fp8vit-fp8-delayed-fastacc-graphed", "fp8vit-fp8-delayed-fastdgrad-graphed",
    "fp8vit-fp8-delayed-splitacc", "fp8vit-fp8-delayed-splitacc-graphed",
    "fp8vit-fp8-delayed-blocksgraph-graphed", "fp8vit-fp8-delayed-stemgraph-graphed-compile",
    "fp8vit-fp8-delayed-blocksgraph-graphed-compile",
    "fp8vit-fp8-delayed-torchadd-graphed", "fp8vit-fp8-delayed-heuristic-graphed",
    "fp8vit-fp8-delayed-tegradadd-graphed",
)

# lever 53's variant parts: the backward GEMMs they give fast accumulation (Variant.fast_accum)
_FAST_ACCUM = {"fastacc": ("dgrad", "wgrad"), "fastdgrad": ("dgrad",), "splitacc": ()}

# -bf16narrow: fused blocks whose width (``cfg.dim``) is below this run with FP8 off
NARROW = 512


@dataclasses.dataclass(frozen=True)
class Variant:
    """A parsed variant name (see the module docstring).

    Attributes:
        name: as in :data:`VARIANTS`.
        blocks: ``"timm"``, ``"te-layer"`` or ``"fp8vit"``.
        fp8: the FP8 recipe name (``"torchao"`` for torchao float8), or None for bf16.
        compile: ``torch.compile`` the model.
        graphed: capture the blocks as CUDA graphs.
        cudnn_norm: TE's LayerNorm on cuDNN's kernels (:func:`fp8vit.set_cudnn_layernorm`).
        linear: the blocks fp8vit cannot fuse get FP8 Linears (``convert_to_te(fallback="linear")``).
        block_compile: the blocks fp8vit cannot fuse are compiled (a Sequential of them as one)
            (``convert_to_te(fallback="compile")``).
        fp8_attention: the attention's matmuls run in FP8 too (TE's ``fp8_dpa``).
        bias_attention: the fused blocks' ``bias_attention`` (``"torch"`` or ``"te"``), or None
            for each family's default.
        bf16_narrow: FP8 off in the fused blocks narrower than :data:`NARROW`.
        patch_gemm: the patch embedding's convolution as one GEMM (``convert_to_te``'s
            ``patch_gemm``, its default; False: ``-convpatch``).
        rope_kernel: the RoPE blocks' ``rope_kernel`` (``"te"``), or None for the default.
        model_norms: the model's own LayerNorms as convert_to_te leaves them (one Triton pass each
            way under autocast); False: torch's (``-torchnorm``).
        layout_opt: ``torch.compile`` with Inductor's ``layout_optimization`` (its default: the
            convolutions of a compiled graph run channels-last); False: off (``-nchw``).
        triton_dbias: the graphs' FP8 bias gradients by fp8vit's kernel; False: TE's (``-tedbias``).
        residual_gemm: the graphs' residual adds in the FP8 GEMMs before them, and their input
            gradients by fp8vit's call; False: torch's add after TE's GEMM, TE's GEMMs
            (``-torchadd``).
        norm_grad_add: the graphs' residual-gradient sums in TE's LayerNorm backward; False:
            autograd's add after it (``-tegradadd``).
        gemm_search: fp8vit's GEMMs on the fastest of cuBLASLt's candidate algorithms; False: on
            its heuristic's first (``-heuristic``; process-wide, for the GEMM forms made after).
        fast_accum: the backward GEMMs whose accumulation is fast, the others' split:
            ``("dgrad", "wgrad")`` (``-fastacc``), ``("dgrad",)`` (``-fastdgrad``), ``()``
            (``-splitacc``), or None for :func:`make_recipe`'s choice.
        stem: ``make_graphed_blocks``' ``stem``: True (``-stemgraph``), False (``-blocksgraph``,
            compiled too), or None for its default (``convert_to_te(compile=True)``'s too, lever 65).
    """

    name: str
    blocks: str
    fp8: Optional[str]
    compile: bool
    graphed: bool
    cudnn_norm: bool = False
    linear: bool = False
    block_compile: bool = False
    fp8_attention: bool = False
    bias_attention: Optional[str] = None
    bf16_narrow: bool = False
    patch_gemm: bool = True
    rope_kernel: Optional[str] = None
    model_norms: bool = True
    layout_opt: bool = True
    triton_dbias: bool = True
    residual_gemm: bool = True
    norm_grad_add: bool = True
    gemm_search: bool = True
    fast_accum: Optional[Tuple[str, ...]] = None
    stem: Optional[bool] = None

    @classmethod
    def parse(cls, name: str) -> "Variant":
        if name not in VARIANTS:
            raise ValueError(f"unknown variant {name!r}; choose from {list(VARIANTS)}")
        cudnn_norm = "-cudnn-norm" in name
        parts = name.replace("-cudnn-norm", "").split("-")
        graphed = "graphed" in parts
        compile_ = parts[-1] == "compile"
        if name.startswith("torchao"):
            return cls(name, "timm", "torchao", True, False)
        if name.startswith("te-layer"):
            return cls(name, "te-layer", "delayed", False, graphed)
        fp8 = parts[2] if name.startswith("fp8vit-fp8") else None
        return cls(name, parts[0], fp8, compile_, graphed, cudnn_norm, linear="linear" in parts,
                   block_compile="blockcompile" in parts, fp8_attention="fp8attn" in parts,
                   bias_attention=next((p[:-4] for p in parts if p in ("torchbias", "tebias")), None),
                   bf16_narrow="bf16narrow" in parts, patch_gemm="convpatch" not in parts,
                   rope_kernel="te" if "terope" in parts else None, model_norms="torchnorm" not in parts,
                   layout_opt="nchw" not in parts, triton_dbias="tedbias" not in parts,
                   residual_gemm="torchadd" not in parts, norm_grad_add="tegradadd" not in parts,
                   gemm_search="heuristic" not in parts,
                   fast_accum=next((acc for p, acc in _FAST_ACCUM.items() if p in parts), None),
                   stem=True if "stemgraph" in parts else False if "blocksgraph" in parts else None)

    @property
    def te_fp8(self) -> bool:
        """Runs TE's FP8 (inside ``fp8_context``)."""
        return self.fp8 not in (None, "torchao")

    def recipe(self):
        """What ``fp8_context`` and the capture get: the recipe name, a TE recipe object where the
        name alone does not say it (``-fp8attn``, ``-fastacc``, ``-fastdgrad``, ``-splitacc``), None
        without TE's FP8."""
        if not self.te_fp8:
            return None
        if self.fast_accum is not None:
            return fast_backward_accumulation(make_recipe(self.fp8), dgrad="dgrad" in self.fast_accum,
                                              wgrad="wgrad" in self.fast_accum)
        return make_recipe(self.fp8, fp8_attention=True) if self.fp8_attention else self.fp8


@dataclasses.dataclass
class Workload:
    """A built model and what its training step needs.

    Attributes:
        model: the model (its parameters are what the optimizer updates).
        variant: what was built.
        net: what the step calls: ``model``, or it wrapped in DDP and/or compiled.
        img_size, num_classes: input resolution and classifier width.
        graphs: the CUDA-graph handles of ``-graphed`` variants: one (``model.blocks``), or one per
            stage of a model whose blocks sit in stages (Swin), each captured at its second
            training step; empty for the others.
        recipe: what ``fp8_context`` gets (:meth:`Variant.recipe`: one object for the capture and
            every step).
    """

    model: nn.Module
    variant: Variant
    net: Callable
    img_size: int
    num_classes: int
    graphs: Tuple[GraphedBlocks, ...] = ()
    recipe: Any = None


def te_layer_block_fn() -> type:
    """A ``block_fn`` for timm's ``VisionTransformer`` made of a plain ``te.TransformerLayer``,
    configured for a ViT (bidirectional ``bshd`` attention, eps 1e-6, timm's dropouts and drop path): what a
    careful user would write by hand with raw TE. A speed reference: it ignores the timm options
    it has no equivalent for (LayerScale, qk_norm, separate biases)."""
    layer = _te.transformer_layer_class()

    class TELayerBlock(layer):
        def __init__(self, dim, num_heads, mlp_ratio=4.0, qkv_bias=False, proj_drop=0.0, attn_drop=0.0,
                     drop_path=0.0, **_):
            super().__init__(hidden_size=dim, ffn_hidden_size=int(dim * mlp_ratio), num_attention_heads=num_heads,
                             hidden_dropout=proj_drop, attention_dropout=attn_drop, attn_input_format="bshd",
                             self_attn_mask_type="no_mask", layernorm_epsilon=1e-6, drop_path_rate=drop_path)

    return TELayerBlock


def _block_linears(model: nn.Module) -> set:
    """Paths of the ``nn.Linear``s inside blocks (``fp8vit.blocks.linear.is_block``; not the head): the
    Linears fp8vit's generic path considers, with no condition on their features."""
    mods = dict(model.named_modules())
    out = set()
    for fqn, mod in mods.items():
        parts = fqn.split(".")
        if isinstance(mod, nn.Linear) and not parts[0].startswith("head") and any(
                is_block(mods[".".join(parts[:i])]) for i in range(1, len(parts))):
            out.add(fqn)
    return out


def _torchao_fp8(model: nn.Module) -> None:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    # The blocks' Linears (timm ViTs: those under blocks.), as fp8vit's generic path picks them.
    linears = _block_linears(model)
    convert_to_float8_training(model, config=Float8LinearConfig(),
                               module_filter_fn=lambda mod, fqn: fqn in linears)


def build_workload(model: str = "huge", variant: str = "fp8vit-fp8-delayed", *, batch_size: Optional[int] = None,
                   img_size: int = 224, num_classes: int = 1000, device: str = "cuda",
                   backend: Optional[str] = None, mlp_recompute: int = 0, ddp: bool = False,
                   drop_path_rate: Optional[float] = None) -> Workload:
    """A randomly initialised timm ViT for one variant.

    Args:
        model: a key of :data:`SIZES` or any timm model name (``vit_base_patch16_224``, ...);
            one whose constructor takes no ``img_size`` (a CNN) is built without it.
        variant: one of :data:`VARIANTS`.
        batch_size: images per step; needed by ``-graphed`` variants (the graphs' shape).
        img_size: input resolution.
        num_classes: classifier width.
        device: where to build it.
        backend: ``TE_Block`` backend (None: automatic).
        mlp_recompute: recompute the MLP activations of every ``mlp_recompute``-th block
            (:func:`fp8vit.set_mlp_recompute`; 0: none). fp8vit variants only.
        ddp: wrap the model in ``DistributedDataParallel`` over the default process group (which
            must be initialized), as a training script does: after the CUDA-graph capture, before
            ``torch.compile``.
        drop_path_rate: timm's ``drop_path_rate`` for the model (stochastic depth, as training
            recipes set it); None: the model's default (0 for ViTs, 0.1 for Swin).

    Raises:
        ValueError: an unknown variant, a graphed variant without ``batch_size``, or
            ``mlp_recompute`` for a variant that does not run fp8vit's blocks.
    """
    v = Variant.parse(variant)
    recipe = v.recipe()
    if mlp_recompute and v.blocks != "fp8vit":
        raise ValueError(f"mlp_recompute={mlp_recompute} needs fp8vit's blocks; variant {variant!r} runs "
                         f"{v.blocks}'s: pass mlp_recompute=0 for it")
    kw = {} if drop_path_rate is None else {"drop_path_rate": drop_path_rate}
    if v.blocks == "te-layer":
        kw["block_fn"] = te_layer_block_fn()
    net = _timm_model(model, img_size, num_classes, **kw).to(device)
    eager_cudnn_norm = v.cudnn_norm and not v.graphed  # graphed: only the captured graphs use it
    if eager_cudnn_norm or _te.cudnn_norm_enabled():  # a variant without the switch runs TE's kernels
        set_cudnn_layernorm(eager_cudnn_norm)
    if v.blocks == "fp8vit":
        _te.set_algorithm_search(v.gemm_search)
        convert_to_te(net, backend=backend, fallback="linear" if v.linear else "compile" if v.block_compile else "keep",
                      patch_gemm=v.patch_gemm)
        # block switches (FP8Block's; a block without such attention or RoPE ignores its value)
        switches = {k: val for k, val in (("bias_attention", v.bias_attention), ("rope_kernel", v.rope_kernel)) if val}
        for m in net.modules():
            if isinstance(m, FP8Block):
                for k, val in switches.items():
                    setattr(m, k, val)
        if not v.model_norms:
            set_model_norms(net, False)
        if v.bf16_narrow:
            narrow = [n for n, m in net.named_modules() if isinstance(m, FP8Block) and m.cfg.dim < NARROW]
            if narrow:
                set_block_fp8(net, narrow, False)
        if mlp_recompute:
            set_mlp_recompute(net, every=mlp_recompute)
    if v.fp8 == "torchao":
        _torchao_fp8(net)
    graphs = ()
    cudnn_norm = True if v.cudnn_norm else None  # None: make_graphed_blocks' default, per width
    if v.graphed:
        if batch_size is None:
            raise ValueError(f"variant {variant!r} captures CUDA graphs: pass batch_size")
        # a ViT's blocks (fp8vit's, raw TE's): all at once; stages (Swin) or branches side by side
        # (CrossViT's MultiScaleBlocks, called with a list): each, by install_graphs
        if isinstance(getattr(net, "blocks", None), (nn.Sequential, nn.ModuleList)) and not branch_blocks(net):
            graphs = (make_graphed_blocks(net.train(), batch_size, recipe=recipe, fp8=v.te_fp8,
                                          cudnn_layernorm=cudnn_norm, triton_dbias=v.triton_dbias, stem=v.stem,
                                          residual_gemm=v.residual_gemm, norm_grad_add=v.norm_grad_add),)
        else:  # blocks in stages (Swin) or branches (CrossViT): convert_to_te(cuda_graphs=True)'s shape cache
            why = install_graphs(net, cudnn_norm, v.triton_dbias, v.stem)
            if why is not None:
                raise ValueError(f"variant {variant!r}: {why}")
            graphs = tuple(graphed_handles(net))
    step_net = net
    if ddp:
        ids = [torch.cuda.current_device()] if device == "cuda" else None
        step_net = torch.nn.parallel.DistributedDataParallel(net, device_ids=ids)
    if v.compile:  # Inductor's config for this compile only (its backward too)
        step_net = torch.compile(step_net, options=None if v.layout_opt else {"layout_optimization": False})
    return Workload(net, v, step_net, img_size, num_classes, graphs, recipe)


def _timm_model(model: str, img_size: int, num_classes: int, **kw) -> nn.Module:
    """The bare timm model: a :data:`SIZES` ViT, or any timm name (built on the current device)."""
    import timm

    if model in SIZES:
        dim, depth, heads = SIZES[model]
        return VisionTransformer(img_size=img_size, patch_size=16, embed_dim=dim, depth=depth,
                                 num_heads=heads, num_classes=num_classes, **kw)
    try:
        return timm.create_model(model, pretrained=False, img_size=img_size, num_classes=num_classes, **kw)
    except TypeError as err:
        if "img_size" not in str(err):
            raise
        # A model built without an input size (a timm CNN) takes any: it still gets img_size images.
        return timm.create_model(model, pretrained=False, num_classes=num_classes, **kw)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What a model's run time scales with, for time estimates.

    Attributes:
        depth: blocks (what ``torch.compile``'s time grows with: it traces each one).
        params: parameters (what building the model on the host takes time for).
        flops_per_image: model FLOPs of a training step per image (:func:`train_flops`), or None.
    """

    depth: int
    params: int
    flops_per_image: Optional[float]


def model_shape(model: str, img_size: int = 224) -> Optional[ModelShape]:
    """:class:`ModelShape` of ``model`` (a :data:`SIZES` key or a timm name), built on the meta
    device (no memory, no initialisation work); None if it cannot be built there."""
    try:
        with torch.device("meta"):
            net = _timm_model(model, img_size, 1000)
    except Exception:  # noqa: BLE001 - an estimate's input: without it the estimate uses a ViT-B's
        return None
    blocks = getattr(net, "blocks", None)
    depth = len(blocks) if isinstance(blocks, (nn.Sequential, nn.ModuleList)) else \
        sum(1 for m in net.modules() if is_block(m))
    flops = train_flops(net, 1, img_size)
    return ModelShape(depth, sum(p.numel() for p in net.parameters()), flops)


def make_optimizer(params, name: str = "sgd", *, lr: float, device: str = "cuda") -> torch.optim.Optimizer:
    """SGD with momentum 0.9 or AdamW, fused (one kernel per step) on CUDA.

    Args:
        params: the parameters to optimize.
        name: ``"sgd"`` or ``"adamw"``.
        lr: learning rate.
        device: ``"cuda"`` enables the fused implementation.
    """
    fused = device == "cuda"
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, fused=fused)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, fused=fused)
    raise ValueError(f"optimizer={name!r}; choose 'sgd' or 'adamw'")


def synthetic_batch(batch: int, wl: Workload, device: str = "cuda", seed: int = 0):
    """Images ``[B, 3, H, W]`` and labels ``[B]`` generated on ``device`` (no input pipeline)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(batch, 3, wl.img_size, wl.img_size, device=device, generator=g)
    y = torch.randint(0, wl.num_classes, (batch,), device=device, generator=g)
    return x, y


def train_step_fn(wl: Workload, optimizer: torch.optim.Optimizer) -> Callable:
    """``step(x, y) -> loss``: forward in the variant's precision, backward, optimizer step."""
    recipe = wl.recipe

    def step(x, y):
        with fp8_context(recipe, enabled=wl.variant.te_fp8):
            loss = F.cross_entropy(wl.net(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _gemm_weights(blk: nn.Module) -> int:
    """Weights of a block's GEMMs: its matrices (qkv, proj, fc1 and fc2, gates; any block kind,
    timm's or TE's, converted or not). Norms, biases and LayerScale are vectors and left out."""
    return sum(p.numel() for p in blk.parameters() if p.dim() == 2)


def _patch_size(model: nn.Module) -> Optional[tuple]:
    """``(height, width)`` of a ViT's patches from ``patch_embed.patch_size`` (None if it has none)."""
    size = getattr(getattr(model, "patch_embed", None), "patch_size", None)
    if isinstance(size, int):
        size = (size, size)
    if isinstance(size, (tuple, list)) and len(size) == 2 and all(isinstance(v, int) and v > 0 for v in size):
        return tuple(size)
    return None


def train_flops(model: nn.Module, batch: int, img_size: int) -> Optional[float]:
    """Model FLOPs of one training step (forward + backward = 3x forward), GEMMs and attention.

    Per block and token: 2 FLOPs per weight of the block's GEMMs (qkv, proj, the MLP's fc1 and
    fc2 whatever their kind: gated MLPs have three matrices' worth), plus ``4 * N * C`` for the
    two attention matmuls; the patch embedding and head are added. Hidden units padded for FP8
    (EVA02-L: 2730 -> 2736) count too, as the GPU runs them.

    Returns:
        the FLOPs, or None for a model this count does not describe: one without a ViT's
        ``patch_embed.patch_size``, ``embed_dim`` and ``blocks`` (a timm CNN, a Swin).
    """
    patch, dim, blocks = _patch_size(model), getattr(model, "embed_dim", None), getattr(model, "blocks", None)
    if patch is None or not isinstance(dim, int) or not isinstance(blocks, (nn.Sequential, nn.ModuleList)) \
            or len(blocks) == 0:
        return None
    # timm's HybridEmbed (ViTamin, R50+ViT): patch_size on the conv stem's features, feature_ratio
    # (16, 16) the stem's reduction: a token per 16x16 pixels, not per pixel
    ratio = getattr(model.patch_embed, "feature_ratio", (1, 1))
    stride = (patch[0] * ratio[0], patch[1] * ratio[1]) if isinstance(ratio, (tuple, list)) else patch
    n_patches = (img_size // stride[0]) * (img_size // stride[1])
    tokens = n_patches + getattr(model, "num_prefix_tokens", 1)
    per_token = sum(2 * _gemm_weights(blk) + 4 * tokens * dim for blk in blocks)
    fwd = batch * tokens * per_token
    fwd += batch * n_patches * 2 * dim * 3 * patch[0] * patch[1]
    head = getattr(model, "head", None)
    if isinstance(head, nn.Linear):
        fwd += batch * 2 * head.in_features * head.out_features
    return 3 * fwd
