"""The graph cache of one model's blocks: :class:`GraphedBlocks`, the captured call signatures
(:class:`GraphShape`) and the dispatch installed as the blocks' ``forward`` (or, with the stem in
the graphs, as a timm ``VisionTransformer``'s ``forward_features``), which replays a graph,
captures one at a signature's second sight, or runs the blocks eagerly.

:func:`fp8vit.training.graphs.make_graphed_blocks` and ``convert_to_te(cuda_graphs=True)`` make
them; that module's docstring says what is captured, when, what it costs and what stays right.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import inspect
import itertools
import operator
import time
import weakref
from typing import Any, Optional, Tuple

import torch
from torch import nn

from .. import _te
from .._warn import warn_once
from .._te.recipes import recipe_name, recipe_settings
from ..blocks.base import FP8Block
from ..blocks.weights import is_sharded
from .detect import gpu_info

# getters that _fingerprint and _copy_aliased_grads apply by map(), in C: per-step scans of every
# block parameter, which a synchronized step pays while the GPU waits
_is, _NONES = operator.is_, itertools.repeat(None)
_REQUIRES_GRAD, _GRAD = operator.attrgetter("requires_grad"), operator.attrgetter("grad")
_DATA_PTR = torch.Tensor.data_ptr
# every block switch its forward reads (FP8Block's): one changed after capture drops the graphs
_SWITCH_NAMES = ("fp8_enabled", "grad_checkpointing", "recompute_mlp", "gelu_in_gemm", "bias_attention", "rope_kernel")
_SWITCHES = operator.attrgetter(*_SWITCH_NAMES)
# A timm VisionTransformer's forward_features in one graph with its blocks (lever 55): the modules and
# parameters it reads, and the module hooks that would run only while TE captures
_FEATURE_MODULES = ("patch_embed", "pos_drop", "patch_drop", "norm_pre", "blocks", "norm")
_FEATURE_PARAMS = ("cls_token", "reg_token", "pos_embed")
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")

__all__ = ["GraphedBlocks", "GraphShape", "WHY_NOT_WITH_FSDP2", "MAX_SHAPES", "TE_TUNED_LAYERNORM_WIDTHS",
           "cudnn_norm_pays", "signature", "stem_why_not"]

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

# Call signatures a handle holds graphs for unless told otherwise: the full batch, the last partial
# batch of an epoch, one more.
MAX_SHAPES = 3
# Signatures seen once and remembered, to be captured at their second sight (the oldest goes first).
_SEEN_LIMIT = 64

_PREFIX = "fp8vit: CUDA-graphed blocks run eagerly (correct, slower): "
_BUSY = ("the previous graph replay is still in use (its backward has not run, the blocks' output it "
         "returned is still referenced, or retain_graph=True), and a replay would overwrite what that "
         "backward reads: this forward runs eagerly. Two forwards before one backward (several crops or "
         "views) run eagerly from the second on")



def signature(shape: Tuple[int, ...], input_dtype: torch.dtype, autocast_dtype: Optional[torch.dtype], recipe: Any,
              spec: tuple) -> tuple:
    """The key of one captured call signature: ``(shape, input dtype, autocast dtype, recipe name,
    keyword inputs' spec, recipe settings)``, recipe name and settings None and ``()`` without FP8.
    The settings (:func:`recipe_settings`) are part of it because the graphs bake some of them in
    (formats, FP8 attention, accumulation): the same recipe name with another margin or
    accumulation is another signature, not these graphs."""
    if recipe is None:
        return tuple(shape), input_dtype, autocast_dtype, None, spec, ()
    return tuple(shape), input_dtype, autocast_dtype, recipe_name(recipe), spec, recipe_settings(recipe)


def _spec(kwargs: dict, defaults: dict) -> tuple:
    """A call's keyword inputs as a hashable signature: ``(shape, dtype, requires_grad)`` of a
    tensor, else the value, left out where it is the forward's default (``is_causal=False`` passed
    or not: one call). ``requires_grad``: a graph captured for a constant input computes no gradient
    for it (mixed RoPE's table, made from learnable frequencies, needs one)."""
    if not kwargs:
        return ()
    out = []
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            out.append((k, (tuple(v.shape), v.dtype, v.requires_grad)))
        else:
            d = defaults.get(k, inspect.Parameter.empty)
            if not (v is d or (type(v) is type(d) and v == d)):
                out.append((k, v))
    return tuple(sorted(out, key=lambda kv: kv[0]))


def _is_tensor_spec(value: Any) -> bool:
    """Whether a value of :func:`_spec`'s signature stands for a tensor input."""
    return isinstance(value, tuple) and len(value) == 3 and isinstance(value[1], torch.dtype)


def _show(value: Any) -> str:
    if _is_tensor_spec(value):
        return f"{list(value[0])} {value[1]}" + (" requiring grad" if value[2] else "")
    return repr(value)


def _uncapturable(blocks: nn.Module, targets: tuple, model: Optional[nn.Module] = None) -> Optional[str]:
    """Why the blocks cannot be captured as they are now (None: they can); ``model``: the ViT
    holding them, whose own checkpointing switch counts too."""
    if any(getattr(m, "grad_checkpointing", False) is True for m in (model, *blocks.modules()) if m is not None):
        return ("activation checkpointing is on; a CUDA graph keeps all activations of its capture, so turn "
                "checkpointing off (model.set_grad_checkpointing(False)) or do not graph this model")
    unfused = [n for n, m in blocks.named_modules()
               if isinstance(m, FP8Block) and m.recompute_mlp and not m.cfg.fused_mlp]
    if unfused:
        # TE's LayerNormMLP recomputes inside its own backward, which the graph captures; an
        # unfused MLP (exact_gelu=True) would need activation checkpointing, refused above.
        return (f"MLP recompute is on in blocks {unfused[:4]} whose MLP is unfused (exact_gelu=True or MLP "
                "dropout), and that recompute uses activation checkpointing, which a captured graph cannot "
                "hold; fp8vit.set_mlp_recompute(model, False) for them, or do not graph this model")
    return None


def _under_fsdp1(blocks: nn.Module) -> bool:
    """Whether FSDP1 (``FullyShardedDataParallel``) wraps the blocks or flattened their parameters."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FullyShardedDataParallel
    return any(getattr(p, "_fsdp_flattened", False) for p in blocks.parameters()) or \
        any(isinstance(m, FullyShardedDataParallel) for m in blocks.modules())


def _use_count(storage: Any) -> int:
    """How many tensors (and storage objects) hold ``storage``."""
    return torch._C._storage_Use_Count(storage._cdata)


@contextlib.contextmanager
def _hooks_set_aside(targets: tuple):
    """Module hooks of the graphed modules, away while TE captures (it refuses modules with hooks;
    registered after capture they run around each replay, as they then are again)."""
    saved = [(t, {n: getattr(t, n) for n in _HOOK_DICTS}) for t in targets]
    for t, _ in saved:
        for n in _HOOK_DICTS:
            setattr(t, n, collections.OrderedDict())
    try:
        yield
    finally:
        for t, hooks in saved:
            for n, d in hooks.items():
                setattr(t, n, d)


def stem_why_not(model: nn.Module) -> Optional[str]:
    """Why ``model``'s stem (patch embedding, class and register tokens, position embedding,
    ``norm_pre``) and final ``norm`` cannot be captured in one graph with its blocks (None: they
    can): that takes timm's own ``VisionTransformer.forward_features`` over ``nn.Sequential``
    blocks and a plain ``PatchEmbed`` (a hybrid's conv stages were not measured in a graph), with
    no module hooks on those parts (they would run while TE captures, never in a replay)."""
    from timm.layers import PatchEmbed
    from timm.models.vision_transformer import VisionTransformer
    fn = getattr(type(model), "forward_features", None)
    if fn is not VisionTransformer.forward_features:
        return (f"{type(model).__name__}.forward_features is not timm VisionTransformer's own "
                f"({getattr(fn, '__qualname__', fn)})")
    if not isinstance(getattr(model, "blocks", None), nn.Sequential):
        return f"its blocks are a {type(model.blocks).__name__}, not an nn.Sequential called as one"
    if type(model.patch_embed) is not PatchEmbed:
        return f"its patch_embed is a {type(model.patch_embed).__name__}, not timm's PatchEmbed"
    hooked = [n for n in _FEATURE_MODULES
              if any(getattr(getattr(model, n, None), d, None) for d in _HOOK_DICTS)]
    if hooked:
        return f"model.{hooked[0]} has module hooks, which a replay of its graph would not run"
    return None


class _Features(nn.Module):
    """A timm ``VisionTransformer``'s ``forward_features`` as one module for TE's capture: images
    ``[B, 3, H, W]`` to normed tokens ``[B, prefix + N, C]``. It holds the ViT's own stem, blocks
    and final norm (the same objects: gradients reach the model's parameters), not the ViT: the head
    stays out of the graphs, and no parameter is listed twice.
    """

    def __init__(self, vit: nn.Module):
        super().__init__()
        for name in _FEATURE_MODULES:
            self.add_module(name, getattr(vit, name, None))
        self._names = tuple(n for n in _FEATURE_PARAMS if isinstance(getattr(vit, n, None), nn.Parameter))
        for name in self._names:
            self.register_parameter(name, getattr(vit, name))
        self._vit = (vit,)  # a tuple: not a submodule

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """Called by TE's capture only (eager calls run the ViT's own ``forward_features``)."""
        vit = self._vit[0]
        # timm's forward_features reads the tokens and position embedding from the ViT: point it at
        # this module's, which TE swaps for fresh leaves while it captures
        own, saved = vit._parameters, {n: vit._parameters[n] for n in self._names}
        own.update((n, self._parameters[n]) for n in self._names)
        try:
            return type(vit).forward_features(vit, x, *args, **kwargs)
        finally:
            own.update(saved)


@dataclasses.dataclass(eq=False)
class GraphShape:
    """One captured call signature of the blocks: its graphs' memory and use.

    Attributes:
        shape: the input shape the graphs replay for: the blocks' ``(B, N, C)``, or with the stem
            in the graphs the images' ``(B, 3, H, W)``.
        input_dtypes: the block input dtype, per graphed module (one for ``nn.Sequential`` blocks;
            per block otherwise: the first block's from the model's stem, each later one's what the
            block before it returns).
        autocast_dtype: torch autocast dtype of the capture.
        recipe_name: the FP8 recipe captured (None: FP8 off).
        call_kwargs: the keyword inputs: ``(shape, dtype, requires_grad)`` for a tensor (replayed with the caller's
            values), the value itself otherwise (must match).
        memory_bytes: GPU memory the capture added (reserved after minus before, caches emptied):
            its static buffers, and the shared pool's growth if this batch was the largest so far.
        capture_seconds: how long the capture took (warm-up passes included).
        replays: forward replays of these graphs (per-block graphs: one per block).
    """

    shape: Tuple[int, ...]
    input_dtypes: Tuple[torch.dtype, ...]
    autocast_dtype: torch.dtype
    recipe_name: Optional[str]
    call_kwargs: dict
    memory_bytes: int = 0
    capture_seconds: float = 0.0
    replays: int = 0
    _key: tuple = dataclasses.field(default=(), repr=False)
    _graphed: tuple = dataclasses.field(default=(), repr=False)
    _recorded: list = dataclasses.field(default_factory=list, repr=False)
    _node: Any = dataclasses.field(default=None, repr=False)  # weakref: the last replay's backward node
    _storage: Any = dataclasses.field(default=None, repr=False)  # the static output's storage
    _idle: int = dataclasses.field(default=0, repr=False)  # its use count when no one else holds it

    @property
    def input_dtype(self) -> torch.dtype:
        return self.input_dtypes[0]

    def _busy(self) -> bool:
        """Whether something may still read what the next replay overwrites: a backward not yet
        run, or the output (or a view or detached alias of it) still held."""
        node = self._node
        return ((node is not None and node() is not None)
                or (self._storage is not None and _use_count(self._storage) > self._idle))


class _AfterBackward:
    """Hook on a replay's backward node: the first time, records the graph's static gradient
    buffers (the views it returned); on the first graphed module's node (its backward runs last),
    marks the replay's backward as done."""

    def __init__(self, handle: "GraphedBlocks", entry: GraphShape, index: int):
        self.handle, self.entry, self.index = handle, entry, index

    def __call__(self, grad_inputs, grad_outputs) -> None:
        entry = self.entry
        if not entry._recorded[self.index]:
            self.handle._static_ptrs.update(g.data_ptr() for g in grad_inputs if g is not None)
            entry._recorded[self.index] = True
        if self.index == 0:
            entry._node = None


class _BeforeBackward:
    """Pre-hook on the node of the last graphed module's replay (its backward runs first): copy
    each ``.grad`` that is still a view of a ``weight.main_grad`` the backward graphs are about to
    rewrite. A loop that sets gradients to None between forward and backward (Lightning's order:
    forward, ``zero_grad()``, backward) leaves none to copy; copying before the forward instead
    cloned every weight gradient there (ViT-H/16: 2.4 GiB a step)."""

    def __init__(self, handle: "GraphedBlocks"):
        self.handle = handle

    def __call__(self, grad_outputs) -> None:
        self.handle._copy_aliased_grads(only=self.handle._main_ptrs)


# The LayerNorm widths TE 2.20 has tuned kernels for (REGISTER_NORM_LAUNCHER(LayerNorm, ..., tuned,
# ...) in transformer_engine/common/normalization/layernorm/ln_{fwd,bwd_semi}_cuda_kernel.cu); at
# any other width it runs its general kernels. There cuDNN's LayerNorm was faster inside the graphs
# under delayed scaling: ViT-H/16 (1280) -7.1 ms a step, Swin-B and ConvNeXt-B (stages of 128 to
# 1024; 1024 tuned) -1.4 and -1.1 ms; at tuned widths it was not: ViT-B (768) +0.5 ms, ViT-L and
# EVA02-L (1024) unchanged (docs/performance.md, levers 8 and 32). Under current scaling TE's fused
# norm + amax kernel has no cuDNN counterpart; RMSNorm was not measured.
TE_TUNED_LAYERNORM_WIDTHS = frozenset((768, 1024, 1536, 2048, 2304, 3072, 3840, 4096, 5120, 6144, 8192, 10240,
                                       12288, 12800, 15360, 16384, 18432, 20480, 24576, 25600, 30720, 32768,
                                       40960, 49152, 65536))


def cudnn_norm_pays(blocks) -> bool:
    """Whether graphs of the fp8vit ``blocks`` (an iterable of them) capture cuDNN's LayerNorm by
    default: every block a LayerNorm block of a width TE has no tuned kernel for
    (:data:`TE_TUNED_LAYERNORM_WIDTHS`; a Swin stage's blocks share one), and TE's core library
    has the switch."""
    cfgs = [b.cfg for b in blocks]
    return bool(cfgs) and all(c.norm == "LayerNorm" and c.dim not in TE_TUNED_LAYERNORM_WIDTHS for c in cfgs) \
        and _te.cudnn_norm_available()


class GraphedBlocks:
    """The CUDA graphs of a model's blocks (:func:`make_graphed_blocks`, ``convert_to_te(cuda_graphs=True)``):
    which call signatures are captured, their memory, and how often the graphs ran.

    ``GraphedBlocks.of(model)`` finds the handle of a model (None: not graphed).

    Attributes:
        shapes: a :class:`GraphShape` per captured signature, in capture order.
        max_shapes: how many signatures may be captured (settable; raising it lets new shapes in).
        replays: forward calls that replayed graphs (per-block graphs: one per block).
        eager_calls: forward calls that ran eagerly; ``eager_reasons`` counts them by reason
            (``"eval"``, ``"new shape"``: first sight, ``"cache full"``, ``"busy"``, ...).
        per_block: one graph pair per block (blocks in an ``nn.ModuleList`` that the model calls
            one by one, with keyword inputs such as EVA's RoPE table), instead of one for all.
        stem: the graphs start from the images: a timm ``VisionTransformer``'s whole
            ``forward_features`` (stem, blocks, final norm) is one graph pair, its dispatch the
            model's ``forward_features`` (:func:`stem_why_not` says where it cannot be; False
            from when a stem joined by default can no longer, and the blocks are graphed alone).
        shape, input_dtype, autocast_dtype, recipe_name, call_kwargs: the first captured
            signature's (None before any capture).
    """

    def __init__(self, blocks: nn.Module, per_block: bool, *, max_shapes: int = MAX_SHAPES,
                 num_warmup_iters: int = 3, cudnn_layernorm: Optional[bool] = None, fused_wgrad: bool = True,
                 fp8: bool = True, amax_reduction_group: Any = None, triton_dbias: bool = True,
                 residual_gemm: bool = True, norm_grad_add: bool = True, vit: Optional[nn.Module] = None,
                 stem_optional: bool = False):
        self._blocks = blocks  # may be half-built here (unpickling, deepcopy): read on first use
        self._vit = vit  # the ViT whose forward_features is graphed whole (None: the blocks alone); as _blocks
        # the stem joined by default (stem=None), not asked for: where it can no longer join, the
        # blocks alone are graphed (_leave_stem) rather than nothing
        self._stem_optional = stem_optional
        self._target_list: Optional[tuple] = None
        self.per_block = per_block
        self.max_shapes = max_shapes
        self.num_warmup_iters = num_warmup_iters
        self.cudnn_layernorm = cudnn_layernorm
        self._fused_wgrad = fused_wgrad
        self._triton_dbias = triton_dbias
        self._residual_gemm = residual_gemm
        self._norm_grad_add = norm_grad_add
        self._fp8 = fp8
        self._group = amax_reduction_group
        self.replays = 0
        self.eager_calls = 0
        self.eager_reasons: collections.Counter = collections.Counter()
        self._entries: "collections.OrderedDict[tuple, GraphShape]" = collections.OrderedDict()
        self._seen: "collections.OrderedDict[tuple, list]" = collections.OrderedDict()
        self._met = 0  # distinct signatures met in training
        self._warned_full = False
        self._capture_failed: Optional[str] = None
        self._capturing = False
        self._released = False
        self._seq: Optional[tuple] = None  # per-block: what the next block of this forward does
        self._pool = None
        self._slots: tuple = ()
        # per graphed module: (its parameters' dicts, their names, its FP8 blocks), for _fingerprint
        self._watch: tuple = ()
        self._stale: Optional[str] = None  # a change a later block's check met, acted on at block 0
        self._fp8_blocks: tuple = ()
        self._stem_modules: tuple = ()  # the modules of the stem and final norm, for their classes
        self._hook_dicts: tuple = ()  # the hook dicts of the ViT's parts that forward_features calls
        self._fingerprint_at_capture = None
        self._params: tuple = ()
        self._main_grad_weights: tuple = ()
        self._main_grads: tuple = ()
        self._static_ptrs: set = set()
        self._main_ptrs: frozenset = frozenset()  # the weight.main_grad buffers among them
        self._defaults: Optional[dict] = None

    def _spec(self, kwargs: dict) -> tuple:
        if not kwargs:
            return ()
        if self._defaults is None:
            fn = type(self._targets[0]).forward if self._vit is None else type(self._vit).forward_features
            params = inspect.signature(fn).parameters
            self._defaults = {n: p.default for n, p in params.items()}
        return _spec(kwargs, self._defaults)

    @property
    def stem(self) -> bool:
        return self._vit is not None

    @property
    def _targets(self) -> tuple:
        """The modules whose forward is graphed: ``model.blocks``, each block, or the ViT's features."""
        if self._target_list is None:
            self._target_list = ((_Features(self._vit),) if self._vit is not None else
                                 tuple(self._blocks) if self.per_block else (self._blocks,))
        return self._target_list

    def _seats(self) -> tuple:
        """``(object, attribute)`` where each graphed module's dispatch sits."""
        if self._vit is not None:
            return ((self._vit, "forward_features"),)
        return tuple((t, "forward") for t in self._targets)

    def _own(self) -> tuple:
        """This handle's dispatch on each graphed module (None where there is none)."""
        out = []
        for obj, attr in self._seats():
            d = vars(obj).get(attr)
            out.append(d if isinstance(d, _Dispatch) and d.handle is self else None)
        return tuple(out)

    # ------------------------------------------------------------------ reading
    @staticmethod
    def of(model: nn.Module) -> Optional["GraphedBlocks"]:
        """The handle of ``model``'s graphed blocks (through a DDP wrapper too), or None."""
        model = getattr(model, "module", model)
        d = vars(model).get("forward_features")
        if isinstance(d, _Dispatch) and d.handle is not None:
            return d.handle
        blocks = getattr(model, "blocks", None)
        if not isinstance(blocks, nn.Module):
            return None
        for m in (blocks, *(blocks if isinstance(blocks, nn.ModuleList) else ())):
            d = vars(m).get("forward")
            if isinstance(d, _Dispatch) and d.handle is not None:
                return d.handle
        return None

    @property
    def shapes(self) -> list:
        return list(self._entries.values())

    @property
    def main_grad_bytes(self) -> int:
        """The fused-wgrad buffers (one fp32 gradient per block weight), shared by all signatures."""
        return sum(w.main_grad.numel() * w.main_grad.element_size() for w in self._main_grad_weights
                   if isinstance(vars(w).get("main_grad"), torch.Tensor))

    @property
    def memory_bytes(self) -> int:
        """GPU memory held for the graphs: every capture's (:attr:`GraphShape.memory_bytes`) and the
        fused-wgrad buffers."""
        return sum(e.memory_bytes for e in self._entries.values()) + self.main_grad_bytes

    @property
    def fused_wgrad(self) -> bool:
        """Whether the backward graphs write weight gradients in the weights' dtype (fp32) into
        ``weight.main_grad`` (asked for with ``fused_wgrad=True``; before any capture: the setting)."""
        return self._fused_wgrad and (not self._entries or bool(self._main_grad_weights))

    def _first(self, attr: str) -> Any:
        entry = next(iter(self._entries.values()), None)
        return None if entry is None else getattr(entry, attr)

    shape = property(lambda self: self._first("shape"))
    input_dtype = property(lambda self: self._first("input_dtype"))
    autocast_dtype = property(lambda self: self._first("autocast_dtype"))
    recipe_name = property(lambda self: self._first("recipe_name"))
    call_kwargs = property(lambda self: self._first("call_kwargs"))

    def describe(self) -> str:
        """The graphs in words (``conversion_summary`` shows it)."""
        shapes = ", ".join(str(list(e.shape)) for e in self._entries.values())
        eager = ", ".join(f"{why} {n}" for why, n in self.eager_reasons.items())
        what = "stem, blocks and norm" if self.stem else "per block" if self.per_block else "model.blocks"
        return (f"{what}: {len(self._entries)} of at most "
                f"{self.max_shapes} batch shapes captured{f' ({shapes})' if shapes else ''}, "
                f"{self.replays} replays, {self.eager_calls} eager calls{f' ({eager})' if eager else ''}, "
                f"{self.memory_bytes / 2**20:.0f} MiB")

    def __repr__(self) -> str:
        shapes = [(list(e.shape), e.recipe_name, e.memory_bytes, e.replays) for e in self._entries.values()]
        return (f"GraphedBlocks(shapes={shapes} (shape, recipe, memory_bytes, replays), max_shapes="
                f"{self.max_shapes}, replays={self.replays}, eager_calls={self.eager_calls}, "
                f"memory_bytes={self.memory_bytes}, per_block={self.per_block}, stem={self.stem})")

    # ------------------------------------------------------------------ lifetime
    def release(self) -> None:
        """Run the blocks eagerly again and let the graphs and their memory go."""
        self._unseat()
        self._released = True

    def _unseat(self) -> None:
        """Take this handle's dispatches off the model and let its graphs and signatures go."""
        for (obj, attr), d in zip(self._seats(), self._own()):
            if d is not None:
                delattr(obj, attr)
        self._drop(remember=False)
        self._seen.clear()

    def clear(self) -> None:
        """Drop the captured graphs and their memory; shapes are captured again as they come (e.g.
        after progressive resizing moved on from the shapes held)."""
        self._drop(remember=False)
        self._seen.clear()
        self._met, self._warned_full, self._capture_failed = 0, False, None

    def __reduce__(self):
        # A copy (deepcopy, pickle) of the model gets the settings and captures its own graphs:
        # these read the original's parameters.
        return (_fresh_handle, (self._blocks, self.per_block, dict(
            max_shapes=self.max_shapes, num_warmup_iters=self.num_warmup_iters, cudnn_layernorm=self.cudnn_layernorm,
            fused_wgrad=self._fused_wgrad, fp8=self._fp8, triton_dbias=self._triton_dbias,
            residual_gemm=self._residual_gemm, norm_grad_add=self._norm_grad_add, vit=self._vit,
            stem_optional=self._stem_optional)))

    def _install(self) -> None:
        for i, (obj, attr) in enumerate(self._seats()):
            setattr(obj, attr, _Dispatch(self, i, None if self.stem else obj))

    def _drop(self, remember: bool) -> None:
        """Let every graph go (``remember``: their signatures are captured again at their next call)."""
        self._copy_aliased_grads()
        for key, entry in self._entries.items():
            entry._graphed, entry._node, entry._storage = (), None, None
            if remember:
                self._seen[key] = list(entry.input_dtypes)
        had = bool(self._entries)
        self._entries.clear()
        _te.release_main_grad(self._main_grad_weights)
        self._main_grad_weights, self._main_grads, self._params = (), (), ()
        self._static_ptrs, self._pool, self._fingerprint_at_capture, self._stale = set(), None, None, None
        self._main_ptrs = frozenset()
        if self._vit is not None:
            self._target_list = None  # built again from the ViT's modules now (one may be replaced)
        if had:
            gc.collect()  # TE's graphed callables hold their graphs in reference cycles
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    # ------------------------------------------------------------------ the call
    def _forward(self, i: int, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        t = self._targets[i]
        if self._capturing or self._released:  # TE's warm-up and capture call the blocks themselves
            return type(t).forward(t, x, *args, **kwargs)
        if not (t if self._vit is None else self._vit).training:
            if i == 0:
                self._seq = None
            return self._eager(t, "eval", None, x, args, kwargs)
        if i:
            return self._follow(i, t, x, args, kwargs)
        self._seq = None
        entry, reason, message = self._choose(x, args, kwargs)
        if entry is None:
            if self.per_block and self._seq is None and len(self._targets) > 1:
                self._seq = ("eager", reason, 1)
            return self._eager(t, reason, message, x, args, kwargs)
        return self._replay(entry, 0, x, kwargs)

    def _eager(self, t: nn.Module, reason: str, message: Optional[str], x, args, kwargs) -> torch.Tensor:
        self.eager_calls += 1
        self.eager_reasons[reason] += 1
        if message:
            warn_once(_PREFIX + message, RuntimeWarning, stacklevel=5)
        if isinstance(t, _Features):  # the ViT as it is now (the target holds what the graphs captured)
            vit = t._vit[0]
            return type(vit).forward_features(vit, x, *args, **kwargs)
        return type(t).forward(t, x, *args, **kwargs)

    def _follow(self, i: int, t: nn.Module, x, args, kwargs) -> torch.Tensor:
        """Per-block graphs, block ``i > 0``: do what block 0 decided for this forward."""
        seq, self._seq = self._seq, None
        if seq is None or seq[2] != i:  # e.g. a block called on its own
            return self._eager(t, "block called alone", None, x, args, kwargs)
        kind, what, _ = seq
        nxt = i + 1 if i + 1 < len(self._targets) else None
        if kind == "replay":
            if (not args and tuple(x.shape) == what.shape and x.dtype == what.input_dtypes[i]
                    and self._spec(kwargs) == what._key[4]):
                changed = self._changed(i)
                if changed is None:
                    return self._replay(what, i, x, kwargs)
                # the blocks before it replayed with their parameters as captured; this one and the
                # rest run eagerly, and the next forward drops the graphs (held until then)
                self._stale = changed
                if nxt:
                    self._seq = ("eager", "parameters changed", nxt)
                return self._eager(t, "parameters changed", None, x, args, kwargs)
            message = (f"block {i} of a graphed forward got {list(x.shape)} {x.dtype} and keyword inputs "
                       f"{self._spec(kwargs)}, its graph was captured for {list(what.shape)} {what.input_dtypes[i]} and "
                       f"{what._key[4]}: it and the blocks after it run eagerly")
            if nxt:
                self._seq = ("eager", "block input", nxt)
            return self._eager(t, "block input", message, x, args, kwargs)
        if kind == "observe":  # first sight: note what each block gets, for the capture
            seen = self._seen.get(what)
            if seen is not None:
                alike = not args and tuple(x.shape) == what[0] and self._spec(kwargs) == what[4]
                seen[i] = x.dtype if alike else False
            if nxt:
                self._seq = ("observe", what, nxt)
            return self._eager(t, "new shape", None, x, args, kwargs)
        if nxt:
            self._seq = ("eager", what, nxt)
        return self._eager(t, what, None, x, args, kwargs)

    @staticmethod
    def _on_gpu(t: torch.Tensor) -> bool:
        return t.is_cuda

    def _call_context(self) -> Tuple[Optional[torch.dtype], Any]:
        """The call's autocast dtype (None: autocast off) and active TE FP8 recipe (None: FP8 off)."""
        if not torch.is_autocast_enabled("cuda"):
            return None, None
        return torch.get_autocast_dtype("cuda"), _te.active_fp8_recipe()

    def _choose(self, x: torch.Tensor, args: tuple, kwargs: dict):
        """``(entry to replay, None, None)`` or ``(None, reason, warning or None)`` for the first
        graphed module's call; captures a signature at its second sight."""
        if not isinstance(x, torch.Tensor):
            return None, "input not a tensor", (f"the blocks were called with a {type(x).__name__}, not one tensor; "
                                                "graphs take one")
        if args:
            return None, "positional inputs", (f"the blocks were called with {len(args)} positional inputs "
                                               "besides x; graphs take keyword inputs only")
        if not self._on_gpu(x):
            return None, "not on a GPU", None
        dtype, recipe = self._call_context()
        if dtype is None:
            return None, "no autocast", ("the call runs outside torch autocast; graphs are captured for a "
                                         "training loop inside fp8_context (its autocast): wrap the forward in it")
        spec = self._spec(kwargs)
        if self._vit is not None:
            if spec:
                return None, "keyword inputs", (f"forward_features got {sorted(k for k, _ in spec)}; the graphs of "
                                                "the stem and blocks take the images alone")
            if x.requires_grad:
                return None, "input requires grad", ("the images require grad, and the graphs of the stem and blocks "
                                                     "compute no image gradient; make_graphed_blocks(model, stem=False) "
                                                     "graphs the blocks alone")
        try:
            hash(spec)
        except TypeError:
            return None, "keyword inputs", (f"a keyword input of the blocks ({sorted(kwargs)}) is neither a tensor "
                                            "nor a hashable value, so no graph can be keyed on it")
        key = signature(x.shape, x.dtype, dtype, recipe, spec)
        if self._entries:
            changed = self._stale or self._changed(0)
            if changed is not None:
                if self._busy():
                    return None, "busy", _BUSY
                self._drop(remember=True)
                warn_once(f"fp8vit: {changed} since the blocks' CUDA graphs were captured: the graphs are dropped "
                          "and captured again as the shapes come (about a second each)", RuntimeWarning, stacklevel=6)
        entry = self._entries.get(key)
        if entry is not None:
            if self._busy():
                return None, "busy", _BUSY
            return entry, None, None
        if not torch.is_grad_enabled():
            return None, "no grad", None
        if self._vit is not None and self._stem_optional:
            why = stem_why_not(self._vit)
            if why is not None and self._can_leave_stem():
                if self._busy():
                    return None, "busy", _BUSY
                self._leave_stem()
                return None, "stem left the graphs", (
                    f"the stem can no longer be captured with the blocks ({why}): from now on the blocks alone "
                    "are graphed (captured again at their second call), the stem and final norm run eagerly")
        why = self._why_not(recipe, kwargs)
        if why is not None:
            return None, "not capturable", why
        return self._miss(key, x, kwargs, recipe)

    def _busy(self) -> bool:
        return any(e._busy() for e in self._entries.values())

    def _can_leave_stem(self) -> bool:
        """Whether the blocks can be graphed alone: still ``model.blocks``, with no forward of
        someone else's on them."""
        return self._vit._modules.get("blocks") is self._blocks and "forward" not in vars(self._blocks)

    def _leave_stem(self) -> None:
        """Graph the blocks alone from now on (the stem joined by default and no longer can: hooks on
        its parts, a patch embedding of another class): the dispatch moves from the ViT's
        ``forward_features`` to ``model.blocks``' ``forward`` (a synchronized step then waits on the
        stem's host work again, ViT-B/16 b128: 0.3-0.6 ms, lever 55)."""
        self._unseat()
        self._met, self._warned_full = 0, False
        self._vit, self._target_list, self._defaults = None, None, None
        self._install()

    def _why_not(self, recipe: Any, kwargs: dict) -> Optional[str]:
        """Why no signature can be captured now (None: one can)."""
        if self._capture_failed:
            return self._capture_failed
        why = None if self._vit is None else stem_why_not(self._vit)
        if why is not None:
            return (f"the stem cannot be captured with the blocks: {why}; make_graphed_blocks(model, stem=False) "
                    "graphs the blocks alone")
        p = next(iter(self._blocks.parameters()), None)
        if p is not None and is_sharded(p):
            return f"model.blocks is sharded by FSDP2 (fully_shard): {WHY_NOT_WITH_FSDP2}"
        if _under_fsdp1(self._blocks):
            return ("model.blocks is managed by FSDP (FullyShardedDataParallel: flat parameters, gathered for "
                    "forward and backward and freed after, which a graph replay does not do); graphs run under "
                    "DDP (Lightning's FSDP strategy: FP8VitPrecision(cuda_graphs=False))")
        if p is not None and not self._on_gpu(p):
            return f"the blocks' parameters are on {p.device}; CUDA graphs need the model on its GPU"
        if recipe is None and self._fp8 and gpu_info().fp8.ok:
            return ("the call runs without FP8 (outside fp8_context, or with FP8 turned off) on a GPU that runs "
                    "FP8, and graphs are captured for the training loop's fp8_context: wrap the forward in "
                    "fp8_context, or make_graphed_blocks(model, fp8=False) for graphs without FP8")
        why = _uncapturable(self._blocks, self._targets, self._vit)  # with the stem, the ViT's checkpointing too
        if why is not None:
            return why
        for k, v in self._spec(kwargs):
            if not _is_tensor_spec(v):
                # Only tensor inputs enter a graph; the others are the forward's defaults at capture.
                return f"the blocks get {k}={v!r}, and a graph takes only tensors or the forward's defaults"
        return None

    def _miss(self, key: tuple, x: torch.Tensor, kwargs: dict, recipe: Any):
        n = len(self._targets)
        seen = self._seen.get(key)
        full = len(self._entries) >= self.max_shapes
        if seen is None:  # first sight: eager, noted
            self._seen[key] = [x.dtype] + [None] * (n - 1)
            while len(self._seen) > _SEEN_LIMIT:
                self._seen.popitem(last=False)
            self._met += 1
            if n > 1:
                self._seq = ("observe", key, 1)
            if full or self._met > self.max_shapes:
                return None, ("cache full" if full else "new shape"), self._too_many(key)
            return None, "new shape", self._unlike(key)
        if full:
            return None, "cache full", self._too_many(key)
        if self._busy():
            return None, "busy", _BUSY
        if None in seen:  # per-block: the first sight did not see every block
            self._seen[key] = [x.dtype] + [None] * (n - 1)
            self._seq = ("observe", key, 1)
            return None, "new shape", None
        if False in seen:
            return None, "not capturable", (f"the blocks of one forward get inputs of other shapes or keyword inputs "
                                            f"than block 0 ({list(key[0])}), which per-block graphs need alike")
        entry = self._capture(key, tuple(seen), kwargs, recipe, lazy=True, device=x.device)
        if entry is None:
            return None, "capture failed", self._capture_failed
        return entry, None, None

    def _too_many(self, key: tuple) -> Optional[str]:
        """The one warning (per handle) when the blocks meet more signatures than ``max_shapes``."""
        if self._warned_full:
            return None
        self._warned_full = True
        held = [list(e.shape) for e in self._entries.values()] or "none yet"
        return (f"the blocks have met {self._met} distinct input signatures in training (this one: "
                f"{list(key[0])}), more than max_shapes={self.max_shapes}; graphs are held for {held} and other "
                "shapes run eagerly. A batch shape that changes from step to step cannot use CUDA graphs: fix it "
                "(drop_last=True, one resolution). To hold more shapes (each adds memory, see memory_bytes): "
                "make_graphed_blocks(model, max_shapes=N), or GraphedBlocks.of(model).max_shapes = N")

    def _unlike(self, key: tuple) -> Optional[str]:
        """Says how a first-seen signature differs from a captured one of the same shape (None: no
        such one): an unusual change, unlike a new batch size."""
        for e in self._entries.values():
            if e.shape != key[0]:
                continue
            if key[1] != e.input_dtype:
                why = f"the input is {key[1]}, the graphs were captured for {e.input_dtype}"
            elif key[2] != e.autocast_dtype:
                why = f"the graphs were captured under {e.autocast_dtype} autocast, the call runs under {key[2]}"
            elif key[3] != e.recipe_name:
                why = (f"the graphs were captured with FP8 recipe {e.recipe_name!r}, the call runs with {key[3]!r} "
                       "(another fp8_context recipe)")
            elif key[5] != e._key[5]:
                now, then = dict(key[5]), dict(e._key[5])
                changed = ", ".join(f"{k} {then.get(k)!r} -> {now.get(k)!r}"
                                    for k in sorted(now.keys() | then.keys()) if now.get(k) != then.get(k))
                why = (f"the call's FP8 recipe {key[3]!r} has other settings than the graphs were captured with "
                       f"({changed})")
            else:
                got, want = dict(key[4]), e.call_kwargs
                names = sorted(set(got) | set(want), key=lambda k: (not isinstance(want.get(k), tuple), k))
                name = next((k for k in names if got.get(k) != want.get(k)), None)  # tensors first
                if name is None:
                    continue
                why = (f"{name} is {_show(got.get(name))}, the graphs were captured for {_show(want.get(name))}"
                       if name in want else f"the call passes {name}, which the capture did not see")
            return f"{why}; it is captured as well if it repeats (max_shapes={self.max_shapes})"
        return None

    # ------------------------------------------------------------------ state the graphs depend on
    def _fingerprint(self, i: int) -> tuple:
        """Graphed module ``i``'s ``(parameters, data pointers, requires_grad flags, children,
        switches)``: what its graph reads that a loop may change between steps. The host checks it
        before each replay (:meth:`_changed`), so the loops over parameters run in C (``map`` over
        ``dict.get`` and tensor getters: a Python loop over PE-core-L's 288 parameters took 426 us
        on a CPU), and per-block graphs check each block before its own replay, while the GPU runs
        the ones before (a synchronized step pays block 0's check only: the GPU has nothing queued
        then)."""
        dicts, names, blocks = self._watch[i]
        params = tuple(map(dict.get, dicts, names))  # None: a parameter set to None since
        if any(map(_is, params, _NONES)):
            ptrs = flags = None
        else:
            ptrs, flags = tuple(map(_DATA_PTR, params)), tuple(map(_REQUIRES_GRAD, params))
        return params, ptrs, flags, self._children(), tuple(map(_SWITCHES, blocks))

    def _children(self) -> tuple:
        """The blocks held by ``model.blocks`` (graphed whole), with the stem also :meth:`_frame`."""
        children = () if self.per_block else tuple(map(id, self._blocks._modules.values()))
        return children if self._vit is None else (children, self._frame())

    def _frame(self) -> tuple:
        """With the stem in the graphs, what else its graph depends on: the ViT's modules that
        ``forward_features`` calls (replaced?), its checkpointing switch, the hooks on those modules
        (their hook dicts as captured: a part replaced since is caught by its id) and the classes
        of the stem's and final norm's modules (fp8vit's norm and patch GEMM switches swap classes)."""
        vit = self._vit
        return (tuple(map(id, map(vit._modules.get, _FEATURE_MODULES))),  # timm's parts are all submodules
                getattr(vit, "grad_checkpointing", False), tuple(map(len, self._hook_dicts)),
                tuple(map(type, self._stem_modules)))

    def _changed(self, i: int) -> Optional[str]:
        """What changed since capture that graphed module ``i``'s graph depends on (None: nothing)."""
        then = self._fingerprint_at_capture[i]
        dicts, names, blocks = self._watch[i]
        params = tuple(map(dict.get, dicts, names))
        # the usual step, nothing changed: compared in C against what was captured, the parameters
        # by identity (a None fails it), without building the whole fingerprint (lever 56)
        if (all(map(_is, params, then[0])) and tuple(map(_DATA_PTR, params)) == then[1]
                and tuple(map(_REQUIRES_GRAD, params)) == then[2] and tuple(map(_SWITCHES, blocks)) == then[4]
                and self._children() == then[3]):
            return None
        now = self._fingerprint(i)
        if now[3] != then[3]:
            if self._vit is not None and now[3][1] != then[3][1]:
                return ("the ViT's stem or final norm was replaced, switched class or got hooks, or checkpointing "
                        "was switched")
            return "model.blocks holds other blocks"
        if now[4] != then[4]:
            return f"a block's {', '.join(_SWITCH_NAMES[:-1])} or {_SWITCH_NAMES[-1]} switch changed"
        # per parameter, in Python: this runs once per change (at capture no parameter was None)
        moved = grad = 0
        for p, p0, ptr, flag in zip(now[0], *then[:3]):
            moved += p is None or p is not p0 or p.data_ptr() != ptr
            grad += p is not None and p.requires_grad != flag
        where = f" (block {i})" if self.per_block else ""
        return (f"requires_grad changed on {grad} block parameters{where}" if grad and not moved else
                f"{moved} block parameters{where} were replaced or moved" if moved and not grad else
                f"requires_grad changed on {grad} block parameters{where} and {moved} were replaced or moved")

    # ------------------------------------------------------------------ replay and capture
    def _replay(self, entry: GraphShape, i: int, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
        if i == 0 and self._static_ptrs:
            # TE's static gradient buffers live in the graphs' pool, which this forward may reuse;
            # main_grad is written by the backward replay only: its views wait (see _BeforeBackward).
            self._copy_aliased_grads(keep=self._main_ptrs)
        graphed = entry._graphed[i]
        tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)} if kwargs else {}
        # The images (the stem in the graphs): the forward graph replays first, and the host work
        # below (autograd's nodes over every parameter, TE's FP8 bookkeeping) runs while the GPU
        # works instead of before it (lever 58). An input that needs a gradient, or a graph captured
        # with one (stem=False), keeps TE's order: launch() returns None.
        launch = None if tensors else getattr(graphed, "launch", None)
        launched = None if launch is None else launch(x)
        if launched is not None:
            x = launched
        weights, grads = self._main_grads[i] if self._main_grads else ((), ())
        if grads and torch.is_grad_enabled():
            x = _MainGradsToAutograd.apply(x, grads, *weights)
        out = graphed(x, **tensors) if launched is None else graphed.call_launched(x)
        entry.replays += 1
        self.replays += 1
        node = out.grad_fn
        if node is not None and (i == 0 or not entry._recorded[i]):
            node.register_hook(_AfterBackward(self, entry, i))
        if node is not None and i + 1 == len(self._targets) and self._main_ptrs:
            node.register_prehook(_BeforeBackward(self))  # the first graphed backward to run
        if i == 0:
            entry._node = weakref.ref(node) if node is not None else None
        if i + 1 < len(self._targets):
            self._seq = ("replay", entry, i + 1)
        elif entry._storage is None:  # the graph's static output: the same storage every replay
            entry._storage = out.untyped_storage()
            entry._idle = _use_count(entry._storage) - 1  # all but ``out``
        return out

    def _copy_aliased_grads(self, keep: frozenset = frozenset(), only: Optional[set] = None) -> None:
        """Copy each ``.grad`` that is a view of a graph's gradient buffer, which the next replay or
        capture rewrites; gradients elsewhere (DDP's bucket views, earlier copies) stay as they are.

        Args:
            keep: buffers not to copy from now (``weight.main_grad``: only a backward replay
                rewrites them, so their views are copied just before one).
            only: copy views of these buffers only (None: of every graph gradient buffer).
        """
        ptrs = self._static_ptrs if only is None else only
        if keep:
            ptrs = ptrs - keep
        if not ptrs:
            return
        grads = tuple(map(_GRAD, self._params))  # in C: this runs before each step's first replay
        if all(map(_is, grads, _NONES)):  # the usual loop: zero_grad() before the forward
            return
        todo = [(p, g) for p, g in zip(self._params, grads) if g is not None and g.data_ptr() in ptrs]
        if todo:  # one multi-tensor kernel, not a copy each (ViT-H/16: ~260 biases and norms a step)
            todo, grads = zip(*todo)
            copies = [torch.empty_like(g) for g in grads]
            torch._foreach_copy_(copies, grads)
            for p, c in zip(todo, copies):
                p.grad = c

    def _capture(self, key: tuple, dtypes: tuple, kwargs: dict, recipe: Any, lazy: bool, device) -> Optional[GraphShape]:
        """Capture the signature ``key``. A lazy capture (inside a training step) that fails (out of
        memory, or TE raising) returns None, stops lazy capture and says why (:attr:`_capture_failed`;
        TE's process-wide state is restored first); a capture asked for with a batch size raises."""
        targets, n, first = self._targets, len(self._targets), not self._entries
        # the images need no gradient (a call whose images require one runs eagerly)
        samples = tuple((torch.randn(key[0], device=device, dtype=dt, requires_grad=not self.stem),) for dt in dtypes)
        tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        # as the call's: TE computes the gradient of an input that requires grad at capture
        sample_kwargs = tuple({k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in tensors.items()}
                              for _ in range(n)) \
            if self.per_block else None
        if first:
            # per graphed module; the features module's own (tokens, position embedding) read on the ViT
            slots = [[(self._vit if m is t and self.stem else m, name)
                      for m in t.modules() for name, p in m._parameters.items() if p is not None] for t in targets]
            self._watch = tuple((tuple(m._parameters for m, _ in ts), tuple(name for _, name in ts),
                                 tuple(m for m in t.modules() if isinstance(m, FP8Block)))
                                for t, ts in zip(targets, slots))
            self._slots = tuple(s for ts in slots for s in ts)
            self._fp8_blocks = tuple(b for w in self._watch for b in w[2])
            self._stem_modules = tuple(m for n, part in targets[0].named_children() if self.stem and n != "blocks"
                                       for m in part.modules())
            parts = map(self._vit._modules.get, _FEATURE_MODULES) if self._vit is not None else ()
            self._hook_dicts = tuple(getattr(m, d) for m in parts if m is not None for d in _HOOK_DICTS)
        self._copy_aliased_grads()  # the warm-up rewrites main_grad
        start = time.perf_counter()
        try:
            graphed, memory, grads_alias, weights = self._run_capture(samples, sample_kwargs, recipe, key[2], first)
        except Exception as err:  # noqa: BLE001 - a capture inside a training step must not end the run
            if not lazy:
                raise
            held = [list(e.shape) for e in self._entries.values()] or "none"
            first_line = (str(err).splitlines() or [""])[0][:200]
            what = ("ran out of GPU memory" if isinstance(err, torch.cuda.OutOfMemoryError)
                    else f"failed ({type(err).__name__})")
            self._capture_failed = (f"capturing the blocks for {list(key[0])} {what}: {first_line}; no shape is "
                                    f"captured from now on, those held ({held}) keep replaying"
                                    + (". drop_last=True, a smaller max_shapes or batch avoids it"
                                       if isinstance(err, torch.cuda.OutOfMemoryError) else ""))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return None
        self._main_grad_weights = tuple(weights)
        mains = []
        for t in targets:
            mine = set(map(id, t.parameters()))
            ws = tuple(w for w in weights if id(w) in mine)
            mains.append((ws, tuple(w.main_grad for w in ws)))
        self._main_grads = tuple(mains)
        self._static_ptrs.update(w.main_grad.data_ptr() for w in weights)
        self._main_ptrs = frozenset(w.main_grad.data_ptr() for w in weights)
        self._params = tuple(p for p in (m._parameters[name] for m, name in self._slots) if p.requires_grad)
        if first:
            self._fingerprint_at_capture = tuple(map(self._fingerprint, range(n)))
        entry = GraphShape(shape=key[0], input_dtypes=tuple(dtypes), autocast_dtype=key[2], recipe_name=key[3],
                           call_kwargs=dict(key[4]), memory_bytes=memory,
                           capture_seconds=time.perf_counter() - start, _key=key, _graphed=graphed,
                           _recorded=[not grads_alias] * n)
        self._entries[key] = entry
        self._seen.pop(key, None)
        return entry

    def _cudnn_norm_for(self, recipe: Any) -> bool:
        """Whether a capture under ``recipe`` runs TE's LayerNorm on cuDNN's kernels: as
        ``cudnn_layernorm`` says, or with None where that was measured faster (:func:`cudnn_norm_pays`)."""
        if self.cudnn_layernorm is not None:
            return self.cudnn_layernorm
        return recipe is not None and recipe_name(recipe) == "delayed" and cudnn_norm_pays(self._fp8_blocks)

    def _run_capture(self, samples: tuple, sample_kwargs: Optional[tuple], recipe: Any, dtype: torch.dtype,
                     first: bool):
        """TE's capture of the graphed modules: ``(graphed forwards, memory added, grads_alias, the
        fused-wgrad weights)``. Restores the parameters' gradients, the CUDA RNG and the
        delayed-scaling state if it fails."""
        targets = self._targets
        dispatches = tuple(d if d is not None else _Dispatch(self, i, t)
                           for i, (t, d) in enumerate(zip(targets, self._own())))
        if first or self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        params = tuple(m._parameters[name] for m, name in self._slots)
        grads = [p.grad for p in params]
        rng = torch.cuda.get_rng_state()
        scaling = _te.save_scaling(targets)
        had_main_grad = set(map(id, self._main_grad_weights))
        weights: tuple = ()
        try:
            with contextlib.ExitStack() as stack:
                if self._cudnn_norm_for(recipe):
                    stack.enter_context(_te.cudnn_norm(True))
                # TE's FP8 bias gradients by fp8vit's kernel in the captured backward (lever 49;
                # without Triton, or under other recipes, TE's own run)
                stack.enter_context(_te.bias_grad_kernel(self._triton_dbias and recipe is not None))
                # the classic ViT block's residual adds in the FP8 GEMMs before them (lever 61)
                stack.enter_context(_te.residual_gemm(self._residual_gemm and recipe is not None))
                # and their gradients' sums in the LayerNorm backward after them (lever 70)
                stack.enter_context(_te.norm_grad_add(self._norm_grad_add and self._residual_gemm
                                                      and recipe is not None))
                if self._fused_wgrad:
                    # fp8vit's blocks only: their TE modules' weights are known to reach the GEMMs as is.
                    weights = tuple(stack.enter_context(_te.wgrad_into_main_grad(self._fp8_blocks, reuse=True)))
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                before = torch.cuda.memory_reserved()
                # no cached casts inside a graph; TE's warm-up runs backward
                stack.enter_context(torch.autocast("cuda", dtype=dtype, cache_enabled=False))
                stack.enter_context(torch.enable_grad())
                stack.enter_context(_hooks_set_aside(targets))
                self._capturing = True
                try:
                    grads_alias = _te.make_graphed_callables(
                        targets, samples, fp8=recipe is not None, recipe=recipe,
                        num_warmup_iters=self.num_warmup_iters, amax_reduction_group=self._group,
                        sample_kwargs=sample_kwargs, pool=self._pool,
                        post_warmup_hook=torch.cuda.empty_cache)  # the warm-up's cached blocks, before capture
                finally:
                    self._capturing = False
                    # with the stem, the dispatch sits on the ViT's forward_features, not on the target
                    graphed = tuple(self._reinstall(t, None if self.stem else d) for t, d in zip(targets, dispatches))
            torch.cuda.empty_cache()
            memory = torch.cuda.memory_reserved() - before
        except BaseException:
            for p, g in zip(params, grads):  # TE sets them to None around its warm-up backward
                p.grad = g
            torch.cuda.set_rng_state(rng)
            _te.restore_scaling(scaling)
            _te.release_main_grad([w for w in weights if id(w) not in had_main_grad])
            raise
        return graphed, memory, grads_alias, weights

    @staticmethod
    def _reinstall(t: nn.Module, dispatch: Optional["_Dispatch"]):
        """Take TE's graphed forward off the module (and the ``backward_dw``/``reset`` it set there),
        put the dispatch back (None: it sits elsewhere); returns TE's forward, without its per-call
        module walk where it is TE's known one (None: the capture failed before setting it)."""
        graphed = vars(t).pop("forward", None)
        for attr in ("backward_dw", "reset"):
            vars(t).pop(attr, None)
        if dispatch is not None:
            t.forward = dispatch
        # lever 41: TE's forward walks every submodule on each call, before the replay
        return None if graphed is None or graphed is dispatch else _te.lean_graphed_forward(graphed)


def _fresh_handle(blocks, per_block, settings) -> GraphedBlocks:
    """A copied model's handle: the settings, no graphs (see :meth:`GraphedBlocks.__reduce__`)."""
    return GraphedBlocks(blocks, per_block, **settings)


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
        # images (the stem in the graphs) need no gradient: the graphs' backward gives None for them,
        # and autograd still runs this backward (no zeros made for it)
        ctx.set_materialize_grads(False)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad, None) + tuple(g.detach() for g in ctx.main_grads)


class _Dispatch:
    """``forward`` of a graphed module (``model.blocks``, or each block): replays a graph of the
    call's signature, captures it at its second sight, or runs the module's own forward.

    Gradients: the backward graph writes each parameter's gradient into a static buffer (TE's, or
    with ``fused_wgrad`` a weight's ``main_grad``), and autograd receives a view of it, which
    becomes ``p.grad`` without a copy when ``p.grad`` was None (the usual ``zero_grad()``; not
    copying them saves 1.65 ms per ViT-H step, docs/performance.md). The next replay rewrites
    those buffers (TE's live in the graphs' memory pool, which the forward replay may already
    reuse; ``main_grad`` only the backward replay writes). So a ``p.grad`` that is still such a view
    (accumulation over micro-batches, ``zero_grad(set_to_none=False)``) is copied before the replay
    that rewrites it (or a capture), and autograd adds to the copy.
    Gradients that are not views of the buffers (DDP's bucket views) are left alone.
    """

    def __init__(self, handle: Optional[GraphedBlocks] = None, index: int = 0, target: Optional[nn.Module] = None,
                 graphed: Any = None, eager: Any = None):
        self.handle, self.index, self.target = handle, index, target

    # torch.compile(model): dynamo must not trace a capture or a replay; the blocks run as graphs
    # (or eagerly) between the compiled parts of the model.
    @torch.compiler.disable
    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if getattr(torch.autograd.profiler, "_is_profiler_enabled", False):
            # a named range in profiles (fp8vit-profile's host time per GPU-idle gap); when not
            # profiling, nothing: a range costs microseconds per call, 24 a step with per-block graphs
            with torch.profiler.record_function("fp8vit::graphed_blocks"):
                return self.handle._forward(self.index, x, *args, **kwargs)
        return self.handle._forward(self.index, x, *args, **kwargs)

    def __reduce__(self):
        return (_Dispatch, (self.handle, self.index, self.target))
