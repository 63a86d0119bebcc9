"""CUDA graphs for a ViT's blocks: forward and backward captured per batch shape, replayed every step.

    model = fp8vit.convert_to_te(timm.create_model("vit_base_patch16_224").cuda(), cuda_graphs=True)
    for x, y in loader:                                  # unchanged training loop, any batch shapes
        with fp8vit.fp8_context():
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

``graphs = fp8vit.make_graphed_blocks(model, batch_size=128)`` does the same and captures that
shape at once; ``make_graphed_blocks(model)`` captures every shape as it comes. ``cuda_graphs=True``
on a module with no ``blocks`` of its own (a LightningModule holding the ViT) graphs the ViTs in it.

Why: below ViT-H an FP8 step is host-bound. TE's Python runs for each of a block's ~10 modules,
so issuing the kernels takes longer than running them (ViT-B/16 batch 128 on an H200,
examples/train_vit.py: 49.0 ms eager, 28.8 ms graphed; README). A graph replays all of the
blocks' kernels with one launch.

The stem too (``stem``, by default where it can): a timm ``VisionTransformer`` (its own
``forward_features``, ``nn.Sequential`` blocks, a plain ``PatchEmbed``) is captured from the images,
patch embedding, tokens, position embedding and final norm with the blocks, as one graph pair on
the model's ``forward_features``: a synchronized step (``loss.item()`` every step, as timm's
``train.py``) then waits for no host work on the stem (ViT-B/16 b128, H100: -0.3 to -0.6 ms).
``convert_to_te(compile=True)`` leaves the stem to the compiler (there it measured faster).

Shapes, a small cache. A graph replays one call signature: the block input's shape ``(B, N, C)``
(with the stem, the images' ``(B, 3, H, W)``) and dtype, the autocast dtype, the FP8 recipe and
the keyword inputs (EVA's RoPE table). A
training call that misses the cache runs eagerly; the *second* training call with the same
signature captures it (TE's ``make_graphed_callables``: a few warm-up passes, then the capture,
about a second) and replays it from then on, up to ``max_shapes`` signatures (default 3: the full
batch, the last partial batch of an epoch, one more). Second sight rather than first: a capture
costs a second and memory, so it is spent on shapes that repeat; a shape seen once (a one-off, or
a batch size that changes every step) costs one eager step and nothing else, and the last partial
batch of an epoch runs eagerly in the first epoch and replays from the second. A call that cannot
replay runs eagerly with one warning naming the reason, and when the blocks meet more distinct
signatures than ``max_shapes`` (a shape that changes every step) one warning says so and how to
fix it: never a silent slowdown. Eval mode runs eagerly (TE captures for training), silently; so
does a training-mode call under ``no_grad`` of a signature not captured.

Capturing inside a training step (at the forward of a repeating shape) leaves training as it was:
TE saves and restores the modules' delayed-scaling state and the CUDA RNG around its warm-up, runs
no amax reduction while capturing (no collective: a rank may capture alone), and restores the
parameters' ``.grad``; a gradient still pointing into buffers the warm-up rewrites (accumulation
over micro-batches) is copied first. TE captures with fresh leaf tensors standing in for the
parameters (same storage; the replays hand gradients to the real ones): the previous step keeps the
parameters' gradient accumulators alive on the default stream, which a backward capture cannot
depend on; and DDP's gradient hooks, on the real parameters, do not fire in the warm-up. So capture
inside a DDP-wrapped forward works and graphs need not be made before DDP wraps the model. FSDP2 cannot
use graphs (:data:`WHY_NOT_WITH_FSDP2`): ``shard_model`` refuses a model with graphed blocks, and
blocks found sharded by another ``fully_shard`` run eagerly with one warning.

Memory, bounded by ``max_shapes``: all signatures share one graph memory pool, which holds the
activations of the largest captured batch (a smaller one reuses them: a graph replays only after
the previous replay's backward, see below). Each signature adds its static buffers: block input
and output and their gradients (4 x B x N x C in the autocast dtype) and TE's gradient buffers of
the parameters without fused wgrad (biases and norms; every weight with ``fused_wgrad=False``).
:attr:`GraphedBlocks.memory_bytes` and ``shapes[i].memory_bytes`` report what each capture added
(reserved GPU memory after minus before, caches emptied). A call that runs eagerly needs its own
activation memory besides.

What stays right: FP8 scales live in device memory and TE updates them outside the graphs
(delayed scaling keeps its amax history); the weight-gradient GEMMs write fp32 gradients into
buffers kept on the weights (``fused_wgrad``, shared by all signatures); parameter gradients are
handed out of the graphs' buffers without a copy and copied only where a ``.grad`` still points
into them at the next replay or capture (so accumulation over micro-batches,
``zero_grad(set_to_none=False)`` and DDP work); the optimizer and ``load_state_dict`` (resuming)
update parameters in place, which the graphs read. A reference to a ``p.grad`` kept across
``zero_grad()`` (set to None) is rewritten by the next step: clone it to keep it.

What is watched, per call: a replay overwrites the graphs' activations and output, so it runs only
once the previous replay's backward has run (or its autograd graph is gone) and the blocks' output
it returned is no longer referenced; else the call runs eagerly with one warning (two forwards
before one backward, ``retain_graph=True``). Trainable parameters changed since capture
(``requires_grad``, a parameter replaced or moved) or a block's FP8, checkpointing, MLP-recompute or
GELU-in-GEMM switch: the graphs, captured for the old set, are dropped and captured again as the
shapes come, with one warning.

MLP recompute (``set_mlp_recompute``) is captured with the blocks when the MLP is TE's fused
``LayerNormMLP`` (the default): it recomputes inside its own backward, which the backward graph
replays. Not capturable (eager with one warning; :func:`make_graphed_blocks` raises): activation
checkpointing (a graph keeps every activation anyway), MLP recompute of an unfused MLP
(``exact_gelu=True``). Module hooks on the graphed modules (``model.blocks``, or EVA's blocks) are
set aside while TE captures (it refuses them) and run around every call; hooks on modules *inside*
a graphed ``nn.Sequential`` run during capture only, not in replays. A deep copy or pickle of the
model carries the graph settings, not the graphs: the copy captures its own.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import nn

from .._validate import check_bool, check_int, check_process_group, check_type
from .._te.recipes import check_recipe
from ..blocks.base import FP8Block
from ..blocks.weights import is_sharded
from ..errors import FP8UnavailableError
from .context import _fp8_context, check_autocast_dtype
from .detect import gpu_info, resolve_recipe
# _Dispatch and _fresh_handle: whole-model pickles made before graph_cache.py name them here
from .graph_cache import (MAX_SHAPES, WHY_NOT_WITH_FSDP2, GraphedBlocks, GraphShape, _Dispatch,  # noqa: F401
                          _fresh_handle, _is_tensor_spec, _spec, _uncapturable, signature, stem_why_not)

__all__ = ["make_graphed_blocks", "GraphedBlocks", "GraphShape", "graphed_modules", "install_graphs",
           "remove_graphs", "graphed_handles", "branch_blocks", "WHY_NOT_WITH_FSDP2", "MAX_SHAPES"]


# Lever 55 (a ViT's stem and final norm in its blocks' graphs) by default: measured on an H100, b128,
# steps interleaved (docs/performance.md): synchronized steps ViT-S/16 -0.39 ms, ViT-B/16 -0.26 and
# -0.60 (two runs), ViT-L/16 and ViT-H/16 within noise (-0.2 to +0.35); pipelined steps unchanged
# (+0.02 to +0.06, one ViT-L run +0.8 not seen again). Under torch.compile it lost (+0.1 / +0.3 ms).
_STEM_BY_DEFAULT = True


def graphed_modules(model: nn.Module) -> list:
    """Names of the submodules of ``model`` (``""``: itself) whose forward (or, with the stem in the
    graphs, ``forward_features``) is the graph dispatch of :func:`make_graphed_blocks` (or of
    ``convert_to_te(cuda_graphs=True)``)."""
    return [name for name, m in model.named_modules() if _dispatch_of(m) is not None]


def _dispatch_of(m: nn.Module) -> Optional[_Dispatch]:
    """The graph dispatch installed on ``m`` (its ``forward``, or a ViT's ``forward_features``), or None."""
    for attr in ("forward", "forward_features"):
        d = vars(m).get(attr)
        if isinstance(d, _Dispatch):
            return d
    return None


def _stem_vit(model: nn.Module, stem: Optional[bool], fn: str, strict: bool = True) -> Optional[nn.Module]:
    """``model`` where its stem and final norm join the blocks' graphs (``stem`` True, or None and
    on by default where :func:`stem_why_not` allows it), else None; ``stem=True`` where it cannot
    raises saying why (``strict``; else None)."""
    if stem is False or (stem is None and not _STEM_BY_DEFAULT):
        return None
    why = stem_why_not(model)
    if why is None:
        return model
    if stem and strict:
        raise ValueError(f"{fn}(stem=True): the stem cannot be captured with the blocks: {why}; stem=False "
                         "graphs the blocks alone")
    return None


def _blocks_of(model: nn.Module, fn: str) -> Tuple[nn.Module, bool, tuple]:
    """``(model.blocks, per_block, the modules whose forward gets graphed)``, or raise saying why not."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, (nn.Sequential, nn.ModuleList)) or len(blocks) == 0:
        staged = " (its blocks sit in stages: convert_to_te(model, cuda_graphs=True) graphs each stage's)" if (
            _vits_inside(model)) else ""
        raise ValueError(f"{fn} needs a timm ViT with its blocks in model.blocks; "
                         f"{type(model).__name__} has no nn.Sequential or nn.ModuleList 'blocks' "
                         f"(found {type(blocks).__name__}){staged}")
    if not _holds_fp8_blocks(blocks) and branch_blocks(model):
        raise ValueError(f"{fn}: {type(model).__name__}'s blocks ({type(blocks[0]).__name__}) hold branches of "
                         "fp8vit blocks, each called with its own tokens; convert_to_te(model, cuda_graphs=True) "
                         "graphs each branch")
    per_block = not isinstance(blocks, nn.Sequential)
    return blocks, per_block, (tuple(blocks) if per_block else (blocks,))


def _holds_fp8_blocks(blocks: nn.Module) -> bool:
    """``blocks`` (an ``nn.Sequential`` or ``nn.ModuleList``) has fp8vit blocks among its children."""
    return any(isinstance(b, FP8Block) for b in blocks)


def _vits_inside(model: nn.Module) -> list:
    """The outermost modules below ``model`` whose ``blocks`` hold fp8vit blocks: the ViTs of a
    wrapper (a LightningModule's ``self.model``, a CLIP model's ``visual.trunk``)."""
    found, prefixes = [], []
    for name, m in model.named_modules():
        if any(name.startswith(p) for p in prefixes):
            continue
        blocks = getattr(m, "blocks", None)
        if isinstance(blocks, (nn.Sequential, nn.ModuleList)) and _holds_fp8_blocks(blocks):
            found.append(m)
            prefixes.append(name + "." if name else "")
    return found


def branch_blocks(model: nn.Module) -> list:
    """Chains of fp8vit blocks side by side: the ``nn.Sequential`` children of a ``blocks``
    ``nn.ModuleList`` made only of them (CrossViT's ``MultiScaleBlock``: one branch per patch size,
    each called with its own tokens ``[B, N_i, C_i]``). Each is graphed as a ViT's ``blocks``."""
    out = []
    for m in model.modules():
        blocks = getattr(m, "blocks", None)
        if isinstance(blocks, nn.ModuleList) and len(blocks) and all(isinstance(b, nn.Sequential) for b in blocks):
            out += [b for b in blocks if _holds_fp8_blocks(b)]
    return out


def graphed_handles(model: nn.Module) -> list:
    """The :class:`GraphedBlocks` of ``model`` (:meth:`GraphedBlocks.of`), or else those of the ViTs
    inside it that :func:`install_graphs` graphed."""
    own = GraphedBlocks.of(model)
    if own is not None:
        return [own]
    found = {}  # every graph dispatch below model (stages, wrapped ViTs, branches), by handle
    for m in model.modules():
        d = _dispatch_of(m)
        if d is not None and d.handle is not None:
            found.setdefault(id(d.handle), d.handle)
    return list(found.values())


def install_graphs(model: nn.Module, cudnn_layernorm: Optional[bool] = None, triton_dbias: bool = True,
                   stem: Optional[bool] = None) -> Optional[str]:
    """``convert_to_te(cuda_graphs=True)``: graphs for ``model.blocks``, each shape captured as it
    comes (:func:`make_graphed_blocks` with no batch size, its defaults). Nothing needs a GPU yet.
    A model whose ``blocks`` hold no fp8vit block but that holds ViTs (a LightningModule's
    ``self.model``, a Swin's stages): theirs; or branches of fp8vit blocks (CrossViT): each branch.
    ``cudnn_layernorm``, ``triton_dbias``, ``stem``: as :func:`make_graphed_blocks`'s (``stem=True``
    where a ViT's stem cannot join: its blocks alone).

    Returns:
        None, or why nothing was installed (no ``blocks`` and no ViT of fp8vit blocks inside,
        sharded, ``forward`` patched by someone else). Already installed: None, unchanged.
    """
    blocks = getattr(model, "blocks", None)
    if not (isinstance(blocks, (nn.Sequential, nn.ModuleList)) and _holds_fp8_blocks(blocks)):
        inner, branches = _vits_inside(model), branch_blocks(model)
        if inner or branches:
            why = [install_graphs(m, cudnn_layernorm, triton_dbias, stem) for m in inner]
            why += [_install(b, b, False, (b,), cudnn_layernorm, triton_dbias) for b in branches]
            return "; ".join(dict.fromkeys(w for w in why if w is not None)) or None  # each reason once
    try:
        blocks, per_block, targets = _blocks_of(model, "cuda_graphs=True")
    except ValueError as err:
        return str(err)
    vit = None if per_block else _stem_vit(model, stem, "cuda_graphs=True", strict=False)
    return _install(model, blocks, per_block, targets, cudnn_layernorm, triton_dbias, vit, stem_optional=stem is None)


def _install(model: nn.Module, blocks: nn.Module, per_block: bool, targets: tuple, cudnn_layernorm: Optional[bool],
             triton_dbias: bool, vit: Optional[nn.Module] = None, stem_optional: bool = False) -> Optional[str]:
    """A :class:`GraphedBlocks` dispatch on ``targets`` (or on ``vit.forward_features``), or why not
    (as :func:`install_graphs`; ``stem_optional``: as ``GraphedBlocks``')."""
    seats = [(t, "forward") for t in targets] if vit is None else [(vit, "forward_features")]
    if any(_dispatch_of(m) is not None for m in (model, *targets)):
        return None  # graphed already
    if any(attr in vars(obj) for obj, attr in seats):
        return ("the blocks' forward is replaced by something else already; they are not graphed" if vit is None else
                "the model's forward_features is replaced by something else already; it is not graphed")
    param = next(iter(blocks.parameters()), None)
    if param is not None and is_sharded(param):
        return f"the blocks are sharded by FSDP2 (fully_shard), so they are not graphed: {WHY_NOT_WITH_FSDP2}"
    GraphedBlocks(blocks, per_block, cudnn_layernorm=cudnn_layernorm, triton_dbias=triton_dbias, vit=vit,
                  stem_optional=stem_optional)._install()
    return None


def remove_graphs(model: nn.Module) -> None:
    """Release the graphs of ``model``'s blocks, or of the ViTs inside it, if any (``convert_from_te``)."""
    for handle in graphed_handles(model):
        handle.release()


def make_graphed_blocks(
    model: nn.Module,
    batch_size: Optional[int] = None,
    *,
    tokens: Optional[int] = None,
    recipe: Any = None,
    fp8: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    num_warmup_iters: int = 3,
    cudnn_layernorm: Optional[bool] = None,
    fused_wgrad: bool = True,
    amax_reduction_group: Any = None,
    max_shapes: int = MAX_SHAPES,
    triton_dbias: bool = True,
    stem: Optional[bool] = None,
    residual_gemm: bool = True,
    norm_grad_add: bool = True,
) -> GraphedBlocks:
    """CUDA graphs for ``model.blocks`` (forward and backward, all blocks in one graph pair each, or
    one per block), one set per call signature, captured as the shapes come (module docstring).

    Call it after :func:`convert_to_te` (``convert_to_te(..., cuda_graphs=True)`` calls it with no
    batch size), before or after DDP wraps the model, and train as usual inside
    :func:`fp8_context`. With ``batch_size``, that shape is captured now, for the given ``recipe``,
    ``fp8`` and ``dtype`` (the model on its GPU); every other shape is captured at its second
    training call, under that call's recipe and autocast dtype, up to ``max_shapes`` in all. A
    signature is the block input's shape and dtype, the autocast dtype, the keyword inputs and the
    recipe with all its settings (the graphs bake some in: formats, FP8 attention, accumulation).

    Args:
        model: a timm ``VisionTransformer`` (its ``blocks`` is an ``nn.Sequential``; an
            ``nn.ModuleList`` gets a graph pair per block); blocks kept as timm ``Block``s by
            ``module_filter_fn`` are captured too.
        batch_size: images per step (per GPU) to capture now; None: nothing now.
        tokens: tokens per image of that capture; default ``patch_embed.num_patches + num_prefix_tokens``.
        recipe: the FP8 recipe of that capture (None: ``fp8_context``'s default).
        fp8: False: graphs without FP8 (the blocks run in ``dtype``), captured also for calls
            outside FP8; True: calls without FP8 on a GPU that runs it are not captured (warned).
        dtype: torch autocast dtype of that capture.
        num_warmup_iters: eager iterations TE runs before each capture (they change no weight,
            gradient or FP8 state).
        cudnn_layernorm: capture TE's LayerNorm forward and backward with cuDNN's kernels
            (:func:`set_cudnn_layernorm`) instead of TE's own; only the graphs use them, and the
            process-wide setting is restored after capture. None (default): where that was
            measured faster, i.e. under delayed scaling for LayerNorm blocks of a width TE has
            no tuned kernel for (``graph_cache.TE_TUNED_LAYERNORM_WIDTHS``; on an H200 ViT-H/16:
            -4% step time, Swin-B -2.2%, ConvNeXt-B -1.6%; ViT-B and L, at tuned widths:
            unchanged; docs/performance.md, levers 8 and 32); False: TE's own kernels.
        fused_wgrad: the backward graphs' weight-gradient GEMMs write each weight's gradient in
            the weight's dtype (fp32) into a buffer kept on the weight (``weight.main_grad``, one
            for all shapes), which becomes ``p.grad``, instead of writing bf16 that autograd then
            casts (TE's ``fuse_wgrad_accumulation``; docs/performance.md, lever 15). The weight
            gradients are then fp32 GEMM outputs, not bf16-rounded ones. The buffers stay
            allocated (one gradient's worth of the blocks' weights) until ``release()``. ViT-H/16
            on an H200: -1.2 to -1.9 ms per step, +2.4 GiB peak, 16 images less of largest batch;
            False gives that memory back. Eager calls always get TE's bf16 gradients.
        amax_reduction_group: the process group given to TE's captures (TE reduces no amax while
            capturing); the replays take the group of the enclosing ``fp8_context``.
        max_shapes: how many call signatures get graphs (the ``batch_size`` one included); each
            holds its static buffers, and all share the activation memory of the largest
            (:attr:`GraphedBlocks.memory_bytes`). Other shapes run eagerly.
        triton_dbias: the backward graphs cast each FP8 Linear's output gradient, transpose it and
            sum its columns (the bias gradient) with fp8vit's Triton kernel instead of TE's
            ``bgrad_quantize`` (delayed scaling; the same FP8 bytes, the bias gradient summed in
            another order; docs/performance.md, lever 49). ViT-B/16 b128 on an H100: -0.6 ms a
            step, ViT-L/16 -1.5 ms. Where Triton cannot run, TE's kernel is captured. False: TE's.
        stem: True: a timm ``VisionTransformer``'s whole ``forward_features`` (patch embedding,
            class and register tokens, position embedding, ``norm_pre``, the blocks, the final
            ``norm``) is captured as one graph pair from the images, keyed on the image shape: a
            synchronized step (``loss.item()`` every step) then waits for no host work on the stem
            (docs/performance.md, lever 55). Calls whose images require grad or that pass
            ``forward_features`` keyword inputs run eagerly. False: the blocks alone (under
            ``torch.compile`` too the stem measured faster inside the graphs: ViT-B/16 b128,
            H100, -0.6 ms synchronized, +0.2 pipelined; lever 65). None (default): True where
            :func:`stem_why_not` allows it and no ``tokens`` is given, else the blocks alone;
            where the stem can no longer join later (hooks added to its parts or the final norm,
            a patch embedding of another class), the blocks alone are graphed from then on, with
            one warning (with True those calls run eagerly). ViT-S/16 and ViT-B/16 b128 on an
            H100: -0.3 to -0.6 ms a synchronized step, pipelined steps unchanged; ViT-L/16,
            ViT-H/16: unchanged.
        residual_gemm: the forward graphs add the residual stream in the FP8 GEMM before each add
            of the classic ViT block (``TE_Block``: ``x + proj(o)``, ``x + fc2(h)``), read as
            cuBLASLt's C matrix by fp8vit's own cuBLASLt call, instead of a GEMM then an add
            (docs/performance.md, lever 61). Only blocks without LayerScale, drop path or dropout
            at work and with a bf16 stream; the others, and any GEMM cuBLASLt refuses, add as
            before. The sum is rounded to bf16 once instead of twice. ViT-L/16 b128 on an H100:
            -2.1 ms a step, ViT-B/16 -0.6 ms. The captured input-gradient GEMMs of TE's modules
            run by the same call, and each of these GEMM forms on the fastest of cuBLASLt's first
            8 algorithms, timed once outside the capture (lever 62: ViT-L -1.5 ms, ViT-B -0.2).
            False: TE's GEMMs, then the add.
        norm_grad_add: where ``residual_gemm`` takes a block's add, the backward graphs sum the
            stream's two gradients (the skip path's and the LayerNorm's input gradient) inside
            the LayerNorm backward of TE's ``LayerNormLinear`` / ``LayerNormMLP``, in fp8vit's
            Triton kernel, instead of TE's backward then an add (docs/performance.md, lever 70;
            the sum rounded once). Where Triton cannot run, TE's backward and the add. False:
            those always.

    Returns:
        a :class:`GraphedBlocks` handle (shapes, memory, replay counts, ``release()``).

    Raises:
        TypeError: an argument of the wrong type (``model`` not a module, ``batch_size``,
            ``tokens``, ``num_warmup_iters`` or ``max_shapes`` not an integer, a flag not a bool,
            ``recipe`` neither a name nor a TE recipe object, ``amax_reduction_group`` not a
            process group); all arguments are checked first, on any machine.
        ValueError: ``batch_size``, ``tokens`` or ``max_shapes`` below 1, ``num_warmup_iters``
            below 0, an unknown ``recipe`` name, ``dtype`` not an autocast dtype; then ``model``
            has no ``nn.Sequential``/``nn.ModuleList`` ``blocks``, is FSDP2-sharded, uses
            activation checkpointing or MLP recompute of an unfused MLP, passes its blocks
            non-tensor keyword inputs other than the forward's defaults, is
            graphed already, or (with ``batch_size``) is not on a GPU or has no
            ``patch_embed.num_patches`` and no ``tokens``; ``stem=True`` where the stem cannot be
            captured (:func:`stem_why_not`) or with ``tokens``; each names the value.
        FP8UnavailableError: a ``batch_size`` capture with ``fp8`` that cannot run here.
    """
    fn = "make_graphed_blocks"
    check_type(fn, "model", model, nn.Module, "a torch.nn.Module (a timm ViT)")
    check_int(fn, "batch_size", batch_size, min=1, none_ok=True)
    check_int(fn, "tokens", tokens, min=1, none_ok=True)
    check_recipe(fn, recipe)
    check_bool(fn, "fp8", fp8)
    check_autocast_dtype(fn, dtype)
    check_int(fn, "num_warmup_iters", num_warmup_iters, min=0)
    if cudnn_layernorm is not None:
        check_bool(fn, "cudnn_layernorm", cudnn_layernorm)
    check_bool(fn, "fused_wgrad", fused_wgrad)
    check_bool(fn, "triton_dbias", triton_dbias)
    check_bool(fn, "residual_gemm", residual_gemm)
    check_bool(fn, "norm_grad_add", norm_grad_add)
    check_process_group(fn, "amax_reduction_group", amax_reduction_group)
    check_int(fn, "max_shapes", max_shapes, min=1)
    if stem is not None:
        check_bool(fn, "stem", stem)
    blocks, per_block, targets = _blocks_of(model, fn)
    if stem and tokens is not None:
        raise ValueError(f"make_graphed_blocks: tokens={tokens} sets the blocks' sequence length, and stem=True "
                         "captures from the images (their size is the model's img_size); pass one of them")
    vit = None if tokens is not None else _stem_vit(model, stem, fn)
    now = batch_size is not None
    if now and not per_block and tokens is None and not isinstance(
            getattr(getattr(model, "patch_embed", None), "num_patches", None), int):
        raise ValueError(f"make_graphed_blocks: a {type(model).__name__} has no patch_embed.num_patches to "
                         "tell the tokens per image from; pass tokens=, the sequence length its blocks see")
    param = next(blocks.parameters())
    if is_sharded(param):
        raise ValueError(f"make_graphed_blocks: the blocks' parameters are {type(param).__name__}s, sharded by "
                         f"FSDP2 (fully_shard); {WHY_NOT_WITH_FSDP2}: capture before sharding is refused too, "
                         "so graph the model and wrap it in DDP, or shard it and train eagerly")
    if now and param.device.type != "cuda":
        raise ValueError(f"make_graphed_blocks: the blocks are on {param.device}; CUDA graphs need the "
                         "model on its GPU (model.cuda() first)")
    why = _uncapturable(blocks, targets, model)
    if why is not None:
        raise ValueError(f"make_graphed_blocks: {why}")
    old = [vars(t).get("forward") for t in targets if "forward" in vars(t)]
    if "forward_features" in vars(model):
        old.append(vars(model)["forward_features"])
    if old:
        handle = old[0].handle if isinstance(old[0], _Dispatch) else None
        if handle is None or handle._entries or len(old) != len(handle._seats()):
            raise ValueError("make_graphed_blocks: model.blocks is already graphed (or its forward, or the "
                             "model's forward_features, is patched); call release() on the earlier result first")
        handle.release()  # set up, never captured (convert_to_te(cuda_graphs=True)): replaced
    te_recipe = None
    if now and fp8:
        info = gpu_info()
        if not info.fp8.ok:
            raise FP8UnavailableError(f"make_graphed_blocks(fp8=True): FP8 cannot run here: {info.fp8.reason}; "
                                      "pass fp8=False to graph the blocks in bf16")
        te_recipe = resolve_recipe(recipe, info.recipes)
    if now:
        if per_block:
            # The model calls each block itself, with keyword inputs (EVA: rope=the RoPE table): see
            # what it passes, on one image, and capture each block with those inputs.
            dtypes, x_seen, call_kwargs = _block_calls(model, blocks, param.device, dtype)
            shape = (batch_size, *(x_seen.shape[1:] if tokens is None else (tokens, x_seen.shape[-1])))
        elif vit is not None:  # the images, at the model's size
            # (a PatchEmbed without img_size has no num_patches either: refused above, naming tokens=)
            proj = model.patch_embed.proj
            shape = (batch_size, proj.in_channels, *model.patch_embed.img_size)
            dtypes, call_kwargs = (proj.weight.dtype,), {}
        else:
            if tokens is None:
                tokens = model.patch_embed.num_patches + getattr(model, "num_prefix_tokens", 0)
            shape = (batch_size, tokens, model.embed_dim)
            in_dtype = model.pos_embed.dtype if getattr(model, "pos_embed", None) is not None else param.dtype
            dtypes, call_kwargs = (in_dtype,), {}
    handle = GraphedBlocks(blocks, per_block, max_shapes=max_shapes, num_warmup_iters=num_warmup_iters,
                           cudnn_layernorm=cudnn_layernorm, fused_wgrad=fused_wgrad, fp8=fp8,
                           amax_reduction_group=amax_reduction_group, triton_dbias=triton_dbias,
                           residual_gemm=residual_gemm, norm_grad_add=norm_grad_add, vit=vit,
                           stem_optional=stem is None)
    if now:
        spec = handle._spec(call_kwargs)
        odd = [f"{k}={v!r}" for k, v in spec if not _is_tensor_spec(v)]
        if odd:
            raise ValueError(f"make_graphed_blocks: {type(model).__name__} passes its blocks {odd[0]}; a graph takes "
                             "tensor keyword inputs, or the forward's defaults")
    handle._install()
    if now:
        key = signature(shape, dtypes[0], dtype, te_recipe, spec)
        graphed = [blocks] if vit is None else [m for m in handle._targets[0].children()]
        was_training = [m.training for m in graphed]
        for m in graphed:
            m.train()
        try:
            handle._capture(key, dtypes, call_kwargs, te_recipe, lazy=False, device=param.device)
        except BaseException:
            handle.release()
            raise
        finally:
            for m, mode in zip(graphed, was_training):
                m.train(mode)
        handle._met = 1
    return handle


class _SeenCall(Exception):
    """Raised by the hook of :func:`_block_calls` once it has seen the last block's inputs."""


def _block_calls(model: nn.Module, blocks: nn.ModuleList, device, dtype: torch.dtype):
    """What ``model`` passes its blocks, from a forward of one random image under the training
    autocast (stopped at the last block, which does not run).

    Returns:
        ``(dtypes, x, kwargs)``: each block's input dtype (the first block's from the model's stem;
        the others' from the block before them: the autocast dtype for fp8vit's blocks), the first
        block's input, and its keyword arguments (EVA: ``rope``, ``attn_mask``, ``is_causal``).
    """
    seen = []

    def hook(mod, args, kwargs):
        # a keyword tensor keeps whether it requires grad (mixed RoPE's table, made from learnable
        # frequencies): a training call's signature has it, and the capture must compute its gradient
        seen.append((args[0].detach(), {k: (v.detach().requires_grad_(v.requires_grad)
                                            if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}))
        if mod is blocks[-1]:
            raise _SeenCall

    pe = getattr(model, "patch_embed", None)
    size = tuple(getattr(pe, "img_size", None) or (224, 224))
    chans = getattr(model, "in_chans", 3)
    handles = [b.register_forward_pre_hook(hook, with_kwargs=True) for b in blocks]
    try:
        # FP8 off (an explicit fp8_context, so a model that carries FP8 calls through): the probe
        # must not move the delayed-scaling amax history with a random image. Grad on, as in a
        # training step, for the keyword inputs' requires_grad; the graph is dropped unused.
        with torch.enable_grad(), _fp8_context(None, False, dtype, False, None):
            model(torch.randn(1, chans, *size, device=device, dtype=next(model.parameters()).dtype))
    except _SeenCall:
        pass
    finally:
        for h in handles:
            h.remove()
    if len(seen) != len(blocks):
        raise ValueError(f"make_graphed_blocks: a forward of {type(model).__name__} called {len(seen)} of its "
                         f"{len(blocks)} model.blocks; per-block graphs need each block called once per forward")
    return tuple(x.dtype for x, _ in seen), seen[0][0], seen[0][1]
