"""Convert a built timm model for FP8 and back, keeping weights: its blocks become fp8vit's fused
blocks where fp8vit has a family for them (``fp8vit.blocks.families``), and, with ``fallback="linear"``,
the ``nn.Linear``s of the other blocks become FP8 Linears (``fp8vit.blocks.linear``).

Modelled on torchao's ``convert_to_float8_training(module, *, module_filter_fn, config)``:
in place, returns the model, an optional filter decides per module.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
from typing import Dict, List, Optional, Tuple

from torch import nn

from ._validate import check_bool, check_choice, check_model, check_module_filter
from .blocks.backend import check_backend, resolve_backend
from .blocks.compiled import (allow_recompiles, compile_block, compile_units, is_compiled_at, is_compiled_block,
                              uncompile_block)
from .blocks.base import FP8Block
from .blocks.families import FAMILIES, fp8vit_block_for
from .blocks.model_norm import set_model_norms
from .blocks.linear import (holds_linear, is_block, is_swapped, restore_owner, swap_refusal, switch_owner, to_fp8_linear,
                            to_torch_linear)
from .blocks.weights import is_sharded
from .errors import ConversionError
from .summary import EXCLUDED, ConversionSummary, forget_summary, record_summary
from .training.autocast import remove_fp8_autocast, set_fp8_autocast
from .training.graphs import install_graphs, remove_graphs
from .training.switches import (ModuleFilter, checkpointing_on, install_checkpointing, patch_embed_convs,
                                remove_checkpointing, set_grad_checkpointing, set_patch_gemm)

__all__ = ["convert_to_te", "convert_from_te", "ModuleFilter", "FALLBACKS"]

# What convert_to_te does with a block it cannot fuse (see its docstring).
FALLBACKS = ("linear", "keep", "error", "compile")


def _parent(model: nn.Module, fqn: str) -> Tuple[nn.Module, str]:
    parent_name, _, child = fqn.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), child


def _swap(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent, child = _parent(model, fqn)
    setattr(parent, child, new)


def convert_to_te(
    model: nn.Module,
    *,
    module_filter_fn: Optional[ModuleFilter] = None,
    exact_gelu: bool = False,
    backend: Optional[str] = None,
    fp32_residual: bool = False,
    fallback: str = "keep",
    autocast: bool = False,
    cuda_graphs: Optional[bool] = None,
    compile: bool = False,  # noqa: A002 - torch.compile's name, what it does
    patch_gemm: bool = True,
) -> nn.Module:
    """Give ``model`` FP8, in place: fp8vit's fused blocks where it has them, else (optionally) FP8 Linears.

    Every block whose exact class fp8vit has a family for (``fp8vit.blocks.families``: timm's
    ``vision_transformer.Block`` -> ``TE_Block``, ``eva.EvaBlock`` and ``eva.EvaBlockPostNorm`` ->
    ``TE_EvaBlock``) becomes that family's fused block: weights
    copied exactly (timm's QKV layout kept), as are training mode, device, dtype and frozen
    parameters (``requires_grad``). A block fp8vit cannot fuse, because it has no family for its
    class (Swin, CaiT, XCiT, ``ResPostBlock``, ``DiffAttention`` blocks, ...) or the block uses an
    option its family cannot honour, goes to ``fallback``. Also makes
    ``model.set_grad_checkpointing()`` use TE's FP8-aware checkpointing and, where blocks were
    fused, runs the model's own LayerNorms (``norm``, ``fc_norm``, ``norm_pre``) under autocast as
    one Triton pass each way (``fp8vit.blocks.model_norm``: their class only changes; the same
    parameters, state dict and fp32 output; ``FP8VIT_TRITON=0``: torch's). Everything is built
    before anything is swapped: a failure leaves the model unchanged. Calling it again, or on a
    model built with ``block_fn=TE_Block``, converts what is left.

    What it did is in :func:`fp8vit.conversion_summary` (model); it warns once (the summary's
    short form) when it keeps anything that ``module_filter_fn`` did not ask it to keep, and when
    the model holds nothing to convert.

    Args:
        model: a timm model (or any module holding timm blocks), or a block itself (a fused
            block is then returned in its place).
        module_filter_fn: ``fn(module, fqn) -> bool``, called with every block fp8vit would fuse
            or whose Linears it would swap, and with every Linear it would swap; False keeps
            that module (and what it holds) as it is (e.g. keep the first and last block in bf16).
        exact_gelu: keep timm's erf GELU (unfused MLP) instead of TE's tanh GELU kernel.
        backend: ``"te"``, ``"reference"`` or None (automatic); see ``TE_Block``.
        fp32_residual: keep the residual stream in fp32 under autocast (timm's behaviour; slower,
            see ``TE_Block``).
        fallback: for the blocks fp8vit cannot fuse. ``"linear"``: swap their ``nn.Linear``s for
            TE's FP8 ``Linear`` (``fp8vit.blocks.linear``: the same parameters and state dict keys, any
            leading dims, FP8 only inside ``fp8_context``; Linears whose features are not
            multiples of 16 stay as they are). ``"keep"``: leave them as they are (they run in
            bf16 under autocast). ``"error"``: raise :class:`ConversionError`. ``"compile"``: keep
            them, each compiled in place with ``nn.Module.compile()`` (``torch.compile``, default
            options; the same module object, parameters and state dict keys); the outermost
            unfused block holding Linears is compiled, fused blocks are not; an ``nn.Sequential``
            of such blocks only (Swin's ``layers.N.blocks``) is compiled as one unit, as its
            blocks one by one are one compilation each (``fp8vit.blocks.compiled``). Compilation
            happens at the first call; a block or unit that fails to compile warns once, naming
            it and the error, and runs eagerly from then on (an error its eager forward raises too
            is raised as it is). Opt-in, not yet measured. The default is
            ``"keep"`` because the swap was measured no faster than timm's bf16 eager step (H200,
            batch 128: Swin-B 0.90x, BEiT-B 1.00x; docs/families.md): it saves memory, not time.
        autocast: True: the model carries FP8 (:func:`fp8vit.set_fp8_autocast` with its defaults),
            so that an unchanged bf16 loop, with no ``fp8_context``, trains it in FP8. Where the
            model holds nothing FP8 runs in, it warns and installs nothing.
        cuda_graphs: True: the blocks run as CUDA graphs, each batch shape captured at its second
            training step (:func:`fp8vit.make_graphed_blocks` with no batch size: at most 3 shapes,
            the rest and eval eager), so that an unchanged loop gets them. Needs no GPU yet; warns
            and installs nothing where the model has no ``blocks``. None (default): as ``compile``
            where blocks were fused (fused blocks left eager inside a compiled model are
            host-bound: ViT-B/16 on an H200 80.7 ms a step against 28.9 graphed), else False.
            ``shard_model`` releases graphs not captured yet (FSDP2 cannot use them), with a warning.
        compile: True: the model is compiled in place (``nn.Module.compile()``, ``torch.compile``'s
            defaults: the same module object, parameters and state dict keys) around its fused
            blocks, which run outside dynamo (TE kernels, or CUDA graphs with ``cuda_graphs=True``):
            patch embedding, conv stages, the blocks fp8vit keeps, heads. Compiled at the first
            call; a model that fails to compile warns once, naming the error, and runs eagerly.
            It graphs the fused blocks too unless ``cuda_graphs=False``, with a plain ViT's stem
            (patch embedding, tokens, position embedding; lever 65); fused blocks that then run
            eagerly inside it warn at their first call: that measured slower than not compiling
            (ViT-B/16, H200). Not with ``fallback="compile"`` (that compiles the kept blocks, not the
            model) nor on a block itself. Opt-in: with the graphs, measured fastest on the 8 models of
            docs/performance.md's compile sweep.
        patch_gemm: where blocks were fused, the patch embedding's convolution (each timm
            ``PatchEmbed``'s, kernel == stride) runs as one GEMM under bf16/fp16 autocast
            (:func:`fp8vit.set_patch_gemm`: the same module, parameters and state dict; fp32 runs
            the convolution): ViT-B/16 graphed 0.7 ms a step faster on an H100 (lever 39,
            docs/performance.md). False leaves the convolutions as they are.

    Returns:
        ``model`` (or the fused block replacing it, if ``model`` is a block of a family).

    Raises:
        TypeError: ``model`` is not a module, ``module_filter_fn`` not callable, ``exact_gelu`` or
            ``fp32_residual``, ``autocast``, ``cuda_graphs``, ``compile`` or ``patch_gemm`` not a bool,
            ``backend`` or ``fallback`` not a str; nothing is changed.
        ValueError: an unknown ``backend`` or ``fallback``, or ``compile=True`` with
            ``fallback="compile"`` or on a block; nothing is changed.
        ConversionError: with ``fallback="error"``: a block (chosen by the filter) cannot be
            fused, named with its path and the reason, or ``model`` holds nothing to convert.
    """
    fn = "convert_to_te"
    check_model(fn, model)
    check_module_filter(fn, module_filter_fn)
    check_bool(fn, "exact_gelu", exact_gelu)
    # The blocks' own check, made here: a bad name raised inside each block's construction, where
    # it read as "this block cannot be fused" and the block was kept (the conversion "succeeded").
    check_backend(fn, backend)
    check_bool(fn, "fp32_residual", fp32_residual)
    check_choice(fn, "fallback", fallback, FALLBACKS)
    check_bool(fn, "autocast", autocast)
    if cuda_graphs is not None:
        check_bool(fn, "cuda_graphs", cuda_graphs)
    check_bool(fn, "compile", compile)
    check_bool(fn, "patch_gemm", patch_gemm)
    if compile and fallback == "compile":
        raise ValueError("convert_to_te(compile=True, fallback='compile'): fallback='compile' compiles the blocks "
                         "fp8vit cannot fuse, compile=True the whole model, them included: pass one")
    kw = dict(exact_gelu=exact_gelu, backend=backend, fp32_residual=fp32_residual)
    plan = _Plan(model, module_filter_fn, fallback, kw)
    plan.walk(model, "", None)
    summary = plan.decide()
    if fallback == "error" and plan.empty:
        raise ConversionError(f"{type(model).__name__} holds nothing fp8vit can convert: {_NOTHING}")
    if compile and ("" in plan.fuse or isinstance(model, FP8Block)):
        raise ValueError(f"convert_to_te(compile=True): the {type(model).__name__} passed is a block itself; compile=True "
                         "compiles a model around its fused blocks (whose forward runs outside dynamo): convert "
                         "the model that holds the block")
    # Everything is built: swap it all in.
    linear_backend = resolve_backend(backend) if plan.swap else None
    linears = {fqn: to_fp8_linear(lin, linear_backend) for fqn, lin in plan.swap.items()}
    if "" in plan.fuse:  # the model is a block of a family
        model = plan.fuse.pop("")
    for fqn, block in plan.fuse.items():
        _swap(model, fqn, block)
    for fqn, new in linears.items():
        parent, name = _parent(model, fqn)
        switch_owner(new, parent, name)
        setattr(parent, name, new)
    units = compile_units(model, plan.compile)
    for fqn, children in units:
        compile_block(model.get_submodule(fqn), fqn, unit=children)
    if units:
        allow_recompiles(len(units))
    if summary.num_fused or summary.num_swapped:
        install_checkpointing(model)
    if patch_gemm and summary.num_fused and patch_embed_convs(model):
        set_patch_gemm(model)
    if summary.num_fused and not isinstance(model, FP8Block):  # the bf16 stream out of fused blocks:
        set_model_norms(model)  # the model's own norms in one pass (lever 45)
    record_summary(model, summary)
    holds_fp8 = bool(summary.num_fused or summary.num_swapped)
    if autocast and holds_fp8:
        set_fp8_autocast(model)
    graphs = cuda_graphs if cuda_graphs is not None else bool(compile and summary.num_fused)
    # compiled too, the stem joins the graphs (lever 65, ViT-B/16 b128, H100: -0.6 ms synchronized,
    # +0.2 pipelined against the stem compiled outside them)
    not_graphed = install_graphs(model) if graphs else None
    if not_graphed:
        how = "cuda_graphs=True" if cuda_graphs else "compile=True, whose fused blocks get CUDA graphs by default"
        warnings.warn(f"fp8vit.convert_to_te({how}): {not_graphed}", UserWarning, stacklevel=2)
    if compile and not is_compiled_block(model):
        # eager fused blocks called from the compiled model warn at that call (blocks.base), not
        # here: make_graphed_blocks may still come
        compile_block(model, "", origin="convert_to_te(compile=True)")
    no_forward = ("; autocast=True installed no FP8 forward: nothing in the model runs FP8"
                  if autocast and not holds_fp8 else "")
    if compile and not holds_fp8:
        if not plan.empty:
            no_forward += "; compile=True compiled it, nothing runs in FP8"
    elif not holds_fp8 and not summary.compiled and summary.kept and not plan.empty:
        # Swin, ConvNeXt-like or CaiT blocks only: nothing of fp8vit runs, so nothing gets faster
        no_forward += ("; nothing runs in FP8, so this model is not faster converted: torch.compile(model) "
                       "is the way to a faster step here (fallback='linear' swaps the kept blocks' Linears for "
                       "FP8 ones: for memory, 0.90x timm bf16 at Swin-B on the H200, docs/performance.md)")
    if plan.empty:
        warnings.warn(f"fp8vit.convert_to_te: {type(model).__name__} holds nothing fp8vit can convert: "
                      f"{_NOTHING}; it is {'compiled only' if compile else 'unchanged'}{no_forward}", UserWarning,
                      stacklevel=2)
    elif summary.unasked_kept:
        warnings.warn(f"{summary.short()}. fp8vit.conversion_summary(model) lists them{no_forward}", UserWarning,
                      stacklevel=2)
    elif no_forward:
        warnings.warn(f"fp8vit.convert_to_te: {summary.short()}{no_forward}", UserWarning, stacklevel=2)
    return model


_NOTHING = (f"no block of fp8vit's families ({', '.join(t for f in FAMILIES for t in f.timm_blocks)}) and no "
            "other block holding nn.Linears (fp8vit.blocks.linear.is_block)")


@dataclasses.dataclass
class _Plan:
    """What :func:`convert_to_te` will do, decided before anything changes.

    ``walk`` visits the model top-down: fp8vit blocks (already fused) and swapped Linears are
    counted, blocks of a family are fused (built here) or handed to the fallback, and every other
    ``nn.Linear`` is noted with the innermost block holding it (None: outside every block).
    ``decide`` then applies the fallback per holding block and returns the summary.
    """

    root: nn.Module
    filter_fn: Optional[ModuleFilter]
    fallback: str
    kw: dict
    fuse: Dict[str, nn.Module] = dataclasses.field(default_factory=dict)
    swap: Dict[str, nn.Linear] = dataclasses.field(default_factory=dict)
    compile: List[str] = dataclasses.field(default_factory=list)
    fused: Dict[str, List[str]] = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    swapped: Dict[str, List[str]] = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    kept: Dict[str, List[str]] = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    compiled: Dict[str, List[str]] = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    outside: List[str] = dataclasses.field(default_factory=list)
    # (fqn, Linear, (holding block's fqn, its class name, why it was not fused))
    linears: List[tuple] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.head = _head_paths(self.root)

    @property
    def empty(self) -> bool:
        """Nothing fused, swapped or even considered (no block of any kind)."""
        return not (self.fused or self.swapped or self.kept or self.fuse or self.linears)

    def _allowed(self, mod: nn.Module, fqn: str) -> bool:
        return self.filter_fn is None or bool(self.filter_fn(mod, fqn))

    def walk(self, mod: nn.Module, fqn: str, holder: Optional[tuple]) -> None:
        if isinstance(mod, FP8Block):
            self.fused[type(mod).__name__].append(fqn)
            return
        if is_swapped(mod) or isinstance(mod, nn.Linear):
            if holder is None and not is_swapped(mod):
                self.outside.append(fqn)
            else:
                self.linears.append((fqn, mod, holder))
            return
        if fqn in self.head:  # the classifier head: never converted
            self.outside.extend(_join(fqn, n) for n, m in mod.named_modules() if isinstance(m, nn.Linear))
            return
        if mod is not self.root and _is_model(mod):  # a timm model inside a wrapper (a LightningModule, ...)
            self.head |= {_join(fqn, p) for p in _head_paths(mod)}
            for name, child in mod.named_children():
                self.walk(child, _join(fqn, name), holder)
            return
        cls = fp8vit_block_for(mod)
        if cls is not None or is_block(mod, root=mod is self.root):
            if not self._allowed(mod, fqn):
                if holds_linear(mod):
                    self.kept[EXCLUDED].append(fqn)
                return
            name = type(mod).__name__
            if cls is None:
                holder = (fqn, name, f"{name}: no fp8vit block for this class")
            else:
                try:
                    self.fuse[fqn] = cls.from_timm(mod, **self.kw)
                except ValueError as err:
                    if self.fallback == "error":
                        raise ConversionError(f"{fqn or name}: {err}") from err
                    holder = (fqn, name, f"{name}: {err}")
                else:
                    self.fused[cls.__name__].append(fqn)
                    return
        for name, child in mod.named_children():
            self.walk(child, _join(fqn, name), holder)

    def decide(self) -> ConversionSummary:
        """Apply the fallback to the Linears of the blocks not fused; the summary of it all."""
        by_holder: Dict[tuple, list] = collections.defaultdict(list)
        for fqn, lin, holder in self.linears:
            if is_swapped(lin):  # swapped by an earlier call
                self.swapped[holder[2] if holder else "swapped earlier"].append(fqn)
            else:
                by_holder[holder].append((fqn, lin))
        for (block, name, why), lins in by_holder.items():
            if self.fallback == "error":
                raise ConversionError(
                    f"{block or '<model>'} ({name}) cannot be converted: fp8vit has no block for {name}; "
                    "convert_to_te(..., fallback='linear') swaps its nn.Linears for FP8 Linears, "
                    "fallback='keep' keeps it as it is, or exclude it with module_filter_fn")
            if self.fallback == "keep":
                self.kept[why].append(block)
                continue
            if self.fallback == "compile":
                if not any(_inside(block, other) for other, _, _ in by_holder):  # the outermost only
                    self.compiled[why].append(block)
                    if not is_compiled_at(self.root, block):  # compiled by an earlier call
                        self.compile.append(block)
                continue
            for fqn, lin in lins:
                refusal = swap_refusal(lin)
                if refusal is None and not self._allowed(lin, fqn):
                    refusal = EXCLUDED
                if refusal is None:
                    self.swap[fqn] = lin
                    self.swapped[why].append(fqn)
                else:
                    self.kept[refusal].append(fqn)
        return ConversionSummary(fallback=self.fallback, fused=_groups(self.fused), swapped=_groups(self.swapped),
                                 kept=_groups(self.kept), compiled=_groups(self.compiled),
                                 outside=tuple(self.outside))


def _groups(d: Dict[str, List[str]]) -> tuple:
    return tuple((key, tuple(paths)) for key, paths in d.items() if paths)


def _inside(fqn: str, other: str) -> bool:
    """Whether the module at ``fqn`` lies strictly inside the one at ``other``."""
    return fqn != other and (other == "" or fqn.startswith(other + "."))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _is_model(mod: nn.Module) -> bool:
    """Whether ``mod`` is a timm model (its API: ``forward_features`` and ``get_classifier``), not a block."""
    return callable(getattr(mod, "forward_features", None)) and callable(getattr(mod, "get_classifier", None))


def _head_paths(model: nn.Module) -> set:
    """Paths of the classifier head: the model's ``head*`` children and what ``get_classifier()``
    returns (timm's API; a tuple for distilled models)."""
    paths = {name for name, _ in model.named_children() if name.startswith("head")}
    get_classifier = getattr(model, "get_classifier", None)
    if callable(get_classifier):
        try:
            heads = get_classifier()
        except (AttributeError, NotImplementedError, TypeError):  # not timm's API after all
            heads = ()
        heads = heads if isinstance(heads, (tuple, list)) else (heads,)
        ids = {id(h) for h in heads if isinstance(h, nn.Module)}
        paths |= {fqn for fqn, m in model.named_modules() if id(m) in ids and fqn}
    return paths


def convert_from_te(model: nn.Module) -> nn.Module:
    """Undo :func:`convert_to_te`, in place: fp8vit's blocks become timm's, swapped Linears ``nn.Linear``s.

    The result's ``state_dict()`` loads into ``timm.create_model(name)``. FP8 scaling state has no
    timm counterpart and is dropped. Frozen parameters stay frozen; activation checkpointing, if
    on, goes back to timm's own. Swapped Linears give back their very parameters, the patch
    embedding its ``nn.Conv2d`` (``patch_gemm``), the model's own norms their LayerNorm class.

    Returns:
        ``model`` (or the timm block replacing it, if ``model`` is an fp8vit block).

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
        ValueError: ``model`` is sharded (FSDP2's ``fully_shard``, :func:`fp8vit.shard_model`:
            its parameters are ``DTensor`` shards); nothing is changed then.
    """
    # A block's to_timm() rebuilds timm's block from its state dict, which under FSDP2 holds
    # DTensor shards: loading them into the new block's plain tensors failed deep inside
    # load_state_dict ("aten.copy_.default got mixed torch.Tensor and DTensor"), and a rebuilt
    # block would not be sharded anyway. Refused before anything changes, saying how instead.
    check_model("convert_from_te", model)
    sharded = [n for n, p in model.named_parameters() if is_sharded(p)]
    if sharded:
        raise ValueError(f"convert_from_te: this {type(model).__name__} is sharded ({len(sharded)} DTensor "
                         f"parameters, e.g. {sharded[0]!r}: FSDP2's fully_shard, fp8vit.shard_model); its timm "
                         "blocks cannot be rebuilt from shards. Save it with fp8vit.save_checkpoint, load that "
                         "into the converted model built without sharding (fp8vit.load_checkpoint, in one "
                         "process too), and convert that one back")
    if isinstance(model, FP8Block):
        return model.to_timm()
    remove_fp8_autocast(model)
    remove_graphs(model)
    set_patch_gemm(model, False)
    set_model_norms(model, False)
    checkpointing = checkpointing_on(model)
    set_grad_checkpointing(model, False)
    new = {fqn: mod.to_timm() for fqn, mod in model.named_modules() if isinstance(mod, FP8Block)}
    for fqn, block in new.items():
        _swap(model, fqn, block)
    for mod in model.modules():
        uncompile_block(mod)
    swapped = [(fqn, mod) for fqn, mod in model.named_modules() if is_swapped(mod)]
    for fqn, mod in swapped:
        parent, name = _parent(model, fqn)
        setattr(parent, name, to_torch_linear(mod))
        restore_owner(mod, parent)
    forget_summary(model)
    if remove_checkpointing(model) and checkpointing:  # back to the class's own method
        model.set_grad_checkpointing(True)
    return model


