"""CUDA graphs for a ViT's blocks: capture the forward and backward once, replay them every step.

    model = fp8vit.convert_to_te(timm.create_model("vit_base_patch16_224").cuda())
    graphs = fp8vit.make_graphed_blocks(model, batch_size=128)   # after convert, before DDP
    for x, y in loader:                                          # unchanged training loop
        with fp8vit.fp8_context():
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

Why: below ViT-H an FP8 step is host-bound. TE's Python runs for each of a block's ~10 modules,
so issuing the kernels takes longer than running them (ViT-B batch 128 on an H200: 44.8 ms
eager, 34.4 ms graphed; docs/performance.md). A graph replays all of the blocks' kernels with one
launch.

What stays right: FP8 scales live in device memory and TE updates them outside the graphs
(delayed scaling keeps its amax history); the weight-gradient GEMMs write fp32 gradients into
buffers kept on the weights (``fused_wgrad``, no bf16 -> fp32 cast kernels); parameter gradients
are handed out of the graph's buffers without a copy and copied only where a ``.grad`` still
points into them at the next replay (so accumulation over micro-batches,
``zero_grad(set_to_none=False)`` and DDP work); the optimizer updates parameters in place, which
the graphs read. A reference to a ``p.grad`` kept across ``zero_grad()`` (set to None) is
rewritten by the next step: clone it to keep it.

What falls back to eager, with one warning saying why: another input shape (e.g. the last,
smaller batch of an epoch), a call outside ``fp8_context`` or with another recipe or autocast
dtype, a change to a block's FP8, checkpointing, MLP-recompute or GELU-in-GEMM switch after
capture. Eval mode always runs eagerly, silently (that is TE's rule).

MLP recompute (``set_mlp_recompute``) is captured with the blocks when the MLP is TE's fused
``LayerNormMLP`` (the default): it recomputes inside its own backward, which the backward graph
replays. Not supported: activation checkpointing (a graph keeps every activation anyway; it
raises), MLP recompute of an unfused MLP (``exact_gelu=True``; it raises), ``torch.save(model)`` /
``copy.deepcopy(model)`` of the graphed model (save ``state_dict()``, or ``release()`` first).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional, Tuple

import torch
from torch import nn

from .. import _te
from .._validate import check_bool, check_int, check_process_group, check_type
from .._warn import warn_once
from .context import check_autocast_dtype
from .detect import gpu_info
from ..errors import FP8UnavailableError
from ..blocks.base import FP8Block
from .._te.recipes import check_recipe, recipe_name
from .detect import resolve_recipe
from ..blocks.weights import is_sharded

__all__ = ["make_graphed_blocks", "GraphedBlocks", "graphed_modules", "WHY_NOT_WITH_FSDP2"]

# Why make_graphed_blocks and FSDP2 (fully_shard) are refused together, from the sources (not
# measured: it needs a GPU). Said by make_graphed_blocks and by fp8vit.training.distributed.shard_model.
WHY_NOT_WITH_FSDP2 = (
    "TE's make_graphed_callables makes each module's parameters part of its graphs' static input "
    "surface (transformer_engine/pytorch/graph.py, _make_graphed_callables), while FSDP2 registers "
    "sharded DTensor parameters between steps and all-gathers them into storage it frees again after "
    "forward and backward (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, free_storage), in "
    "per-block hooks that a graph of the blocks does not run; and the graphs' fused weight gradients "
    "go to weight.main_grad, past FSDP2's reduce-scatter (TE's own FSDP2 test of "
    "fuse_wgrad_accumulation is a strict xfail: tests/pytorch/distributed/fsdp2_tests/"
    "run_fsdp2_fused_adam.py). Graphed blocks train data-parallel under DDP; FSDP2 runs eagerly")


def graphed_modules(model: nn.Module) -> list:
    """Names of the submodules of ``model`` (``""``: itself) whose forward
    :func:`make_graphed_blocks` replaced by its graph dispatch."""
    return [name for name, m in model.named_modules() if isinstance(vars(m).get("forward"), _Dispatch)]


@dataclasses.dataclass
class GraphedBlocks:
    """What :func:`make_graphed_blocks` captured, and how often the graphs ran since.

    Attributes:
        shape: the block input shape the graphs replay for, ``(B, N, C)``.
        input_dtype: the block input dtype at capture (per-block graphs: the first block's; each
            later block's is what the block before it returns under the training autocast).
        autocast_dtype: torch autocast dtype at capture.
        recipe_name: the FP8 recipe captured (None: FP8 off).
        fused_wgrad: the backward graph writes weight gradients in the weights' dtype (see
            :func:`make_graphed_blocks`).
        replays: forward calls that replayed the graphs.
        eager_calls: forward calls that ran eagerly (eval mode, or a mismatch that was warned).
        per_block: one graph pair per block (blocks in an ``nn.ModuleList`` that the model calls
            one by one, with keyword inputs such as EVA's RoPE table), instead of one for all.
        call_kwargs: per block, the keyword inputs the capture saw: ``(shape, dtype)`` for a
            tensor (replayed with the caller's values), the value itself otherwise (must match).
    """

    shape: Tuple[int, ...]
    input_dtype: torch.dtype
    autocast_dtype: torch.dtype
    recipe_name: Optional[str]
    replays: int = 0
    eager_calls: int = 0
    fused_wgrad: bool = False
    per_block: bool = False
    call_kwargs: dict = dataclasses.field(default_factory=dict)
    _blocks: Optional[nn.Module] = dataclasses.field(default=None, repr=False)
    _patched: tuple = dataclasses.field(default=(), repr=False)
    _switches: tuple = dataclasses.field(default=(), repr=False)
    _main_grad_weights: tuple = dataclasses.field(default=(), repr=False)

    def release(self) -> None:
        """Run the blocks eagerly again and let the graphs and their memory go."""
        for mod in self._patched:
            if "forward" in vars(mod):
                del mod.forward
        _te.release_main_grad(self._main_grad_weights)
        self._blocks, self._patched, self._main_grad_weights = None, (), ()

    def mismatch(self, x: torch.Tensor, kwargs: Optional[dict] = None,
                 input_dtype: Optional[torch.dtype] = None) -> Optional[str]:
        """Why a call with block input ``x`` (and keyword inputs ``kwargs``) cannot replay the
        graphs (None: it can); ``input_dtype``: the graph's own, if not :attr:`input_dtype`."""
        kwargs = kwargs or {}
        input_dtype = input_dtype or self.input_dtype
        if kwargs.keys() - self.call_kwargs.keys():
            return f"the call passes {sorted(kwargs.keys() - self.call_kwargs.keys())}, which the capture did not see"
        for name, want in self.call_kwargs.items():
            got = kwargs.get(name)
            if isinstance(want, tuple) and len(want) == 2 and isinstance(want[1], torch.dtype):
                if not isinstance(got, torch.Tensor) or (tuple(got.shape), got.dtype) != want:
                    what = f"{list(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else repr(got)
                    return f"{name} is {what}, the graphs were captured for {list(want[0])} {want[1]}"
            elif got is not want and got != want:
                return f"{name}={got!r}, the graphs were captured with {name}={want!r}"
        if tuple(x.shape) != self.shape:
            return (f"the input is {list(x.shape)}, the graphs were captured for {list(self.shape)} "
                    "(the last, smaller batch of an epoch? use drop_last=True, or capture this shape)")
        if x.dtype != input_dtype:
            return f"the input is {x.dtype}, the graphs were captured for {input_dtype}"
        if not torch.is_autocast_enabled("cuda") or torch.get_autocast_dtype("cuda") != self.autocast_dtype:
            return f"the graphs were captured under {self.autocast_dtype} autocast; wrap the forward in fp8_context"
        active = _te.active_fp8_recipe()
        now = recipe_name(active) if active is not None else None
        if now != self.recipe_name:
            return (f"the graphs were captured with FP8 recipe {self.recipe_name!r}, the call runs with "
                    f"{now!r} (outside fp8_context, or another recipe)")
        if _switches(self._blocks) != self._switches:
            return ("a block's fp8_enabled, grad_checkpointing, recompute_mlp or gelu_in_gemm switch changed "
                    "after capture; call make_graphed_blocks again")
        return None


def _switches(blocks: nn.Module) -> tuple:
    return tuple((m.fp8_enabled, m.grad_checkpointing, m.recompute_mlp, m.gelu_in_gemm)
                 for m in blocks.modules() if isinstance(m, FP8Block))


class _MainGradsToAutograd(torch.autograd.Function):
    """Identity on the blocks' input whose backward hands each fused weight its ``main_grad``.

    With ``fused_wgrad`` TE's backward writes those weights' gradients into ``weight.main_grad``
    and returns none to autograd. This node sits *before* the graphed blocks, so its backward runs
    after theirs and passes the buffers on as the weights' gradients: autograd's AccumulateGrad
    then sets or adds to ``p.grad`` and fires its hooks (DDP's) as for any other gradient.
    ``detach()`` gives autograd a tensor it may keep as ``p.grad`` without a copy.
    """

    @staticmethod
    def forward(ctx, x, main_grads, *weights):
        ctx.main_grads = main_grads
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad, None) + tuple(g.detach() for g in ctx.main_grads)


class _Dispatch:
    """``blocks.forward``: replay the graphs when the call matches the capture, else run eagerly.

    Gradients: the backward graph writes each parameter's gradient into a static buffer (TE's, or
    with ``fused_wgrad`` a weight's ``main_grad``), and autograd receives a view of it, which
    becomes ``p.grad`` without a copy when ``p.grad`` was None (the usual ``zero_grad()``; not
    copying them saves 1.65 ms per ViT-H step, docs/performance.md). The next replay rewrites
    those buffers (TE's live in the graphs' memory pool, which the forward replay may already
    reuse). So before each replay, a ``p.grad`` that is still such a view (accumulation over
    micro-batches, ``zero_grad(set_to_none=False)``) is copied, and autograd adds to the copy.
    Gradients that are not views of the buffers (DDP's bucket views) are left alone.
    """

    def __init__(self, handle: GraphedBlocks, graphed, eager, params: Tuple[nn.Parameter, ...] = (),
                 main_grad_weights: Tuple[nn.Parameter, ...] = (), te_grads_alias: bool = False,
                 input_dtype: Optional[torch.dtype] = None):
        self.handle, self.graphed, self.eager, self.params = handle, graphed, eager, params
        self.input_dtype = input_dtype
        self.main_grad_weights = main_grad_weights
        self.main_grads = tuple(w.main_grad for w in main_grad_weights)
        # data_ptr()s of the buffers that p.grad may alias: the main_grads now, TE's static
        # gradient buffers once the first replay's backward reports them.
        self._static_ptrs = frozenset(g.data_ptr() for g in self.main_grads)
        self._recorded = not te_grads_alias  # TE returns copies (older TE): nothing to record

    def _record_static(self, grad_inputs, grad_outputs) -> None:
        # Hook on the graphed backward node: grad_inputs are the views it returned.
        self._static_ptrs |= frozenset(g.data_ptr() for g in grad_inputs if g is not None)
        self._recorded = True

    def _copy_aliased_grads(self) -> None:
        for p in self.params:
            g = p.grad
            if g is not None and g.data_ptr() in self._static_ptrs:
                p.grad = g.clone()

    def __call__(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        h = self.handle
        if h._blocks.training:
            why = h.mismatch(x, kwargs, self.input_dtype)
            if why is None:
                h.replays += 1
                if self.params:
                    self._copy_aliased_grads()
                if self.main_grads and torch.is_grad_enabled():
                    x = _MainGradsToAutograd.apply(x, self.main_grads, *self.main_grad_weights)
                tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
                out = self.graphed(x, **tensors)
                if not self._recorded and out.grad_fn is not None:
                    out.grad_fn.register_hook(self._record_static)
                return out
            warn_once(f"fp8vit: CUDA-graphed blocks run eagerly (correct, slower): {why}",
                      RuntimeWarning, stacklevel=4)
        h.eager_calls += 1
        return self.eager(x, **kwargs)

    def __reduce__(self):
        raise TypeError("a model with CUDA-graphed blocks cannot be pickled or deep-copied: save "
                        "model.state_dict(), or call release() on make_graphed_blocks' result first")


def make_graphed_blocks(
    model: nn.Module,
    batch_size: int,
    *,
    tokens: Optional[int] = None,
    recipe: Any = None,
    fp8: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    num_warmup_iters: int = 3,
    cudnn_layernorm: bool = False,
    fused_wgrad: bool = True,
    amax_reduction_group: Any = None,
) -> GraphedBlocks:
    """Capture ``model.blocks`` (forward and backward, all blocks in one graph each) for training.

    Call it after :func:`convert_to_te` and before wrapping the model in DDP, with the model on
    its GPU and in train mode. Then train as usual inside :func:`fp8_context` with the same recipe.

    Args:
        model: a timm ``VisionTransformer`` (its ``blocks`` is an ``nn.Sequential``); blocks kept
            as timm ``Block``s by ``module_filter_fn`` are captured too.
        batch_size: images per step (per GPU); the graphs replay for this batch only.
        tokens: tokens per image; default ``patch_embed.num_patches + num_prefix_tokens``.
        recipe: the FP8 recipe the training loop's ``fp8_context`` uses (None: its default).
        fp8: False captures without FP8 (the blocks then run in ``dtype``).
        dtype: torch autocast dtype of the training loop.
        num_warmup_iters: eager iterations TE runs before capture (they do not change weights or
            FP8 state).
        cudnn_layernorm: capture TE's LayerNorm forward and backward with cuDNN's kernels
            (:func:`set_cudnn_layernorm`) instead of TE's own; only the graphs use them, and the
            process-wide setting is restored after capture. ViT-H/16 on an H200: -4% step time;
            ViT-B and L: unchanged (docs/performance.md, lever 8).
        fused_wgrad: the backward graph's weight-gradient GEMMs write each weight's gradient in
            the weight's dtype (fp32) into a buffer kept on the weight (``weight.main_grad``),
            which becomes ``p.grad``, instead of writing bf16 that autograd then casts (TE's
            ``fuse_wgrad_accumulation``; docs/performance.md, lever 15). The weight gradients are
            then fp32 GEMM outputs, not bf16-rounded ones. The buffers stay allocated (one
            gradient's worth of the blocks' weights) until ``release()``. ViT-H/16 on an H200:
            -1.2 to -1.9 ms per step, +2.4 GiB peak, 16 images less of largest batch; False
            gives that memory back. Eager calls (a fallback) always get TE's bf16 gradients.
        amax_reduction_group: the process group TE reduces delayed-scaling amaxes over during its
            warm-up iterations (which all ranks then run together); None: the default group, as
            in :func:`fp8_context`. The replays take the group of the enclosing ``fp8_context``.

    Returns:
        a :class:`GraphedBlocks` handle (shape, replay counts, ``release()``).

    Raises:
        TypeError: an argument of the wrong type (``model`` not a module, ``batch_size``,
            ``tokens`` or ``num_warmup_iters`` not an integer, a flag not a bool, ``recipe`` neither
            a name nor a TE recipe object, ``amax_reduction_group`` not a process group); all
            arguments are checked first, on any machine.
        ValueError: ``batch_size`` or ``tokens`` below 1, ``num_warmup_iters`` below 0, an unknown
            ``recipe`` name, ``dtype`` not an autocast dtype; then ``model`` has no
            ``nn.Sequential`` ``blocks``, no ``patch_embed.num_patches`` and no ``tokens`` given,
            is FSDP2-sharded, is not on a GPU, uses activation checkpointing or MLP recompute of
            an unfused MLP; each names the value.
        FP8UnavailableError: ``fp8`` is asked for and cannot run here.
    """
    fn = "make_graphed_blocks"
    check_type(fn, "model", model, nn.Module, "a torch.nn.Module (a timm ViT)")
    check_int(fn, "batch_size", batch_size, min=1)
    check_int(fn, "tokens", tokens, min=1, none_ok=True)
    check_recipe(fn, recipe)
    check_bool(fn, "fp8", fp8)
    check_autocast_dtype(fn, dtype)
    check_int(fn, "num_warmup_iters", num_warmup_iters, min=0)
    check_bool(fn, "cudnn_layernorm", cudnn_layernorm)
    check_bool(fn, "fused_wgrad", fused_wgrad)
    check_process_group(fn, "amax_reduction_group", amax_reduction_group)
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, (nn.Sequential, nn.ModuleList)) or len(blocks) == 0:
        raise ValueError(f"make_graphed_blocks needs a timm ViT with its blocks in model.blocks; "
                         f"{type(model).__name__} has no nn.Sequential or nn.ModuleList 'blocks' "
                         f"(found {type(blocks).__name__})")
    per_block = not isinstance(blocks, nn.Sequential)
    if not per_block and tokens is None and not isinstance(
            getattr(getattr(model, "patch_embed", None), "num_patches", None), int):
        raise ValueError(f"make_graphed_blocks: a {type(model).__name__} has no patch_embed.num_patches to "
                         "tell the tokens per image from; pass tokens=, the sequence length its blocks see")
    param = next(blocks.parameters())
    if is_sharded(param):
        raise ValueError(f"make_graphed_blocks: the blocks' parameters are {type(param).__name__}s, sharded by "
                         f"FSDP2 (fully_shard); {WHY_NOT_WITH_FSDP2}: capture before sharding is refused too, "
                         "so graph the model and wrap it in DDP, or shard it and train eagerly")
    if param.device.type != "cuda":
        raise ValueError(f"make_graphed_blocks: the blocks are on {param.device}; CUDA graphs need the "
                         "model on its GPU (model.cuda() first)")
    if getattr(model, "grad_checkpointing", False) or any(
            getattr(m, "grad_checkpointing", False) for m in blocks.modules()):
        raise ValueError("make_graphed_blocks: activation checkpointing is on; a CUDA graph keeps all "
                         "activations of its capture, so turn checkpointing off "
                         "(model.set_grad_checkpointing(False)) or do not graph this model")
    unfused = [n for n, m in blocks.named_modules()
               if isinstance(m, FP8Block) and m.recompute_mlp and not m.cfg.fused_mlp]
    if unfused:
        # TE's LayerNormMLP recomputes inside its own backward, which the graph captures; an
        # unfused MLP (exact_gelu=True) would need activation checkpointing, refused above.
        raise ValueError(f"make_graphed_blocks: MLP recompute is on in blocks {unfused[:4]} whose MLP is "
                         "unfused (exact_gelu=True or MLP dropout), and that recompute uses activation "
                         "checkpointing, which a captured graph cannot hold; "
                         "fp8vit.set_mlp_recompute(model, False) for them, or do not graph this model")
    targets = tuple(blocks) if per_block else (blocks,)  # the modules whose forward gets graphed
    if any("forward" in vars(t) for t in targets):
        raise ValueError("make_graphed_blocks: model.blocks is already graphed (or its forward is "
                         "patched); call release() on the earlier result first")
    te_recipe = None
    if fp8:
        info = gpu_info()
        if not info.fp8.ok:
            raise FP8UnavailableError(f"make_graphed_blocks(fp8=True): FP8 cannot run here: {info.fp8.reason}; "
                                      "pass fp8=False to graph the blocks in bf16")
        te_recipe = resolve_recipe(recipe, info.recipes)
    call_kwargs: dict = {}
    if per_block:
        # The model calls each block itself, with keyword inputs (EVA: rope=the RoPE table): see
        # what it passes, on one image, and capture each block with those inputs.
        seen_dtypes, x_seen, call_kwargs = _block_calls(model, blocks, param.device, dtype)
        shape = (batch_size, *(x_seen.shape[1:] if tokens is None else (tokens, x_seen.shape[-1])))
        in_dtype = seen_dtypes[0]
    else:
        if tokens is None:
            tokens = model.patch_embed.num_patches + getattr(model, "num_prefix_tokens", 0)
        shape = (batch_size, tokens, model.embed_dim)
        in_dtype = model.pos_embed.dtype if getattr(model, "pos_embed", None) is not None else param.dtype
    dtypes = seen_dtypes if per_block else (in_dtype,)
    samples = tuple((torch.randn(shape, device=param.device, dtype=dt, requires_grad=True),) for dt in dtypes)
    tensor_kwargs = tuple({k: v.clone() for k, v in call_kwargs.items() if isinstance(v, torch.Tensor)}
                          for _ in targets)
    call_spec = {k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v for k, v in call_kwargs.items()}
    was_training = blocks.training
    blocks.train()
    norm = _te.cudnn_norm(True) if cudnn_layernorm else contextlib.nullcontext()
    # fp8vit's blocks only: their TE modules' weights are known to reach the GEMMs as is.
    te_blocks = [m for m in blocks.modules() if isinstance(m, FP8Block)]
    wgrad = _te.wgrad_into_main_grad(te_blocks) if fused_wgrad else contextlib.nullcontext(())
    # no cached casts inside a graph:
    with norm, wgrad as main_grad_weights, torch.autocast("cuda", dtype=dtype, cache_enabled=False):
        try:
            grads_alias = _te.make_graphed_callables(targets, samples, fp8=fp8, recipe=te_recipe,
                                                     num_warmup_iters=num_warmup_iters,
                                                     amax_reduction_group=amax_reduction_group,
                                                     sample_kwargs=tensor_kwargs if per_block else None)
        except BaseException:
            _te.release_main_grad(main_grad_weights)
            raise
    blocks.train(was_training)
    graphed = [vars(t).pop("forward") for t in targets]  # TE installed them on the instances; ours wrap them
    main_grad_weights = tuple(main_grad_weights)
    handle = GraphedBlocks(shape=tuple(shape), input_dtype=in_dtype, autocast_dtype=dtype,
                           recipe_name=recipe_name(te_recipe) if fp8 else None,
                           fused_wgrad=bool(main_grad_weights), per_block=per_block, call_kwargs=call_spec,
                           _blocks=blocks, _patched=targets, _switches=_switches(blocks),
                           _main_grad_weights=main_grad_weights)
    for t, g, dt in zip(targets, graphed, dtypes):
        params = tuple(p for p in t.parameters() if p.requires_grad) if grads_alias or main_grad_weights else ()
        mine = set(map(id, t.parameters()))
        weights = tuple(w for w in main_grad_weights if id(w) in mine)
        t.forward = _Dispatch(handle, g, t.forward, params, weights, grads_alias, dt)
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
        seen.append((args[0].detach(), {k: (v.detach() if isinstance(v, torch.Tensor) else v)
                                        for k, v in kwargs.items()}))
        if mod is blocks[-1]:
            raise _SeenCall

    pe = getattr(model, "patch_embed", None)
    size = tuple(getattr(pe, "img_size", None) or (224, 224))
    chans = getattr(model, "in_chans", 3)
    handles = [b.register_forward_pre_hook(hook, with_kwargs=True) for b in blocks]
    try:
        with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
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
