"""Convert a built timm model for FP8 and back, keeping weights: its blocks become fp8vit's fused
blocks where fp8vit has a family for them (``fp8vit.families``), and, with ``fallback="linear"``,
the ``nn.Linear``s of the other blocks become FP8 Linears (``fp8vit.linear``).

Modelled on torchao's ``convert_to_float8_training(module, *, module_filter_fn, config)``:
in place, returns the model, an optional filter decides per module.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.utils.checkpoint
from torch import nn

from . import _te
from ._validate import check_bool, check_callable, check_choice, check_int, check_items, check_type
from .backend import check_backend, resolve_backend
from .errors import ConversionError
from .families import FAMILIES, fp8vit_block_for
from .layers import FP8Block
from .linear import is_block, is_swapped, restore_owner, swap_refusal, switch_owner, to_fp8_linear, to_torch_linear
from .summary import EXCLUDED, ConversionSummary, forget_summary, record_summary
from .weights import is_sharded

__all__ = ["convert_to_te", "convert_from_te", "set_grad_checkpointing", "set_mlp_recompute", "set_block_fp8",
           "ModuleFilter", "FALLBACKS"]

ModuleFilter = Callable[[nn.Module, str], bool]

# What convert_to_te does with a block it cannot fuse (see its docstring).
FALLBACKS = ("linear", "keep", "error")


def _parent(model: nn.Module, fqn: str) -> Tuple[nn.Module, str]:
    parent_name, _, child = fqn.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), child


def _swap(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent, child = _parent(model, fqn)
    setattr(parent, child, new)


def _check_model(fn: str, model) -> nn.Module:
    return check_type(fn, "model", model, nn.Module, "a torch.nn.Module (a timm model or block)")


def _check_filter(fn: str, module_filter_fn) -> Optional[ModuleFilter]:
    return check_callable(fn, "module_filter_fn", module_filter_fn, "a callable fn(module, fqn) -> bool",
                          none_ok=True)


def convert_to_te(
    model: nn.Module,
    *,
    module_filter_fn: Optional[ModuleFilter] = None,
    exact_gelu: bool = False,
    backend: Optional[str] = None,
    fp32_residual: bool = False,
    fallback: str = "keep",
) -> nn.Module:
    """Give ``model`` FP8, in place: fp8vit's fused blocks where it has them, else (optionally) FP8 Linears.

    Every block whose exact class fp8vit has a family for (``fp8vit.families``: timm's
    ``vision_transformer.Block`` -> ``TE_Block``, ``eva.EvaBlock`` and ``eva.EvaBlockPostNorm`` ->
    ``TE_EvaBlock``) becomes that family's fused block: weights
    copied exactly (timm's QKV layout kept), as are training mode, device, dtype and frozen
    parameters (``requires_grad``). A block fp8vit cannot fuse, because it has no family for its
    class (Swin, BEiT, CaiT, ``ResPostBlock``, ``DiffAttention`` blocks, ...) or the block uses an
    option its family cannot honour, goes to ``fallback``. Also makes
    ``model.set_grad_checkpointing()`` use TE's FP8-aware checkpointing. Everything is built
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
            TE's FP8 ``Linear`` (``fp8vit.linear``: the same parameters and state dict keys, any
            leading dims, FP8 only inside ``fp8_context``; Linears whose features are not
            multiples of 16 stay as they are). ``"keep"``: leave them as they are (they run in
            bf16 under autocast). ``"error"``: raise :class:`ConversionError`. The default is
            ``"keep"`` because the swap was measured no faster than timm's bf16 eager step (H200,
            batch 128: Swin-B 0.90x, BEiT-B 1.00x; docs/families.md): it saves memory, not time.

    Returns:
        ``model`` (or the fused block replacing it, if ``model`` is a block of a family).

    Raises:
        TypeError: ``model`` is not a module, ``module_filter_fn`` not callable, ``exact_gelu`` or
            ``fp32_residual`` not a bool, ``backend`` or ``fallback`` not a str; nothing is changed.
        ValueError: an unknown ``backend`` or ``fallback``; nothing is changed.
        ConversionError: with ``fallback="error"``: a block (chosen by the filter) cannot be
            fused, named with its path and the reason, or ``model`` holds nothing to convert.
    """
    fn = "convert_to_te"
    _check_model(fn, model)
    _check_filter(fn, module_filter_fn)
    check_bool(fn, "exact_gelu", exact_gelu)
    # The blocks' own check, made here: a bad name raised inside each block's construction, where
    # it read as "this block cannot be fused" and the block was kept (the conversion "succeeded").
    check_backend(fn, backend)
    check_bool(fn, "fp32_residual", fp32_residual)
    check_choice(fn, "fallback", fallback, FALLBACKS)
    kw = dict(exact_gelu=exact_gelu, backend=backend, fp32_residual=fp32_residual)
    plan = _Plan(model, module_filter_fn, fallback, kw)
    plan.walk(model, "", None)
    summary = plan.decide()
    if fallback == "error" and plan.empty:
        raise ConversionError(f"{type(model).__name__} holds nothing fp8vit can convert: {_NOTHING}")
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
    if summary.num_fused or summary.num_swapped:
        _install_checkpointing(model)
    record_summary(model, summary)
    if plan.empty:
        warnings.warn(f"fp8vit.convert_to_te: {type(model).__name__} holds nothing fp8vit can convert: "
                      f"{_NOTHING}; it is unchanged", UserWarning, stacklevel=2)
    elif summary.unasked_kept:
        warnings.warn(f"{summary.short()}. fp8vit.conversion_summary(model) lists them", UserWarning, stacklevel=2)
    return model


_NOTHING = (f"no block of fp8vit's families ({', '.join(t for f in FAMILIES for t in f.timm_blocks)}) and no "
            "other block holding nn.Linears (fp8vit.linear.is_block)")


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
    fused: Dict[str, List[str]] = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    swapped: Dict[str, List[str]] = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    kept: Dict[str, List[str]] = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
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
        cls = fp8vit_block_for(mod)
        if cls is not None or is_block(mod, root=mod is self.root):
            if not self._allowed(mod, fqn):
                if _holds_linear(mod):
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
                                 kept=_groups(self.kept), outside=tuple(self.outside))


def _groups(d: Dict[str, List[str]]) -> tuple:
    return tuple((key, tuple(paths)) for key, paths in d.items() if paths)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _holds_linear(mod: nn.Module) -> bool:
    return any(isinstance(m, nn.Linear) or is_swapped(m) for m in mod.modules())


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
    on, goes back to timm's own. Swapped Linears give back their very parameters.

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
    _check_model("convert_from_te", model)
    sharded = [n for n, p in model.named_parameters() if is_sharded(p)]
    if sharded:
        raise ValueError(f"convert_from_te: this {type(model).__name__} is sharded ({len(sharded)} DTensor "
                         f"parameters, e.g. {sharded[0]!r}: FSDP2's fully_shard, fp8vit.shard_model); its timm "
                         "blocks cannot be rebuilt from shards. Save it with fp8vit.save_checkpoint, load that "
                         "into the converted model built without sharding (fp8vit.load_checkpoint, in one "
                         "process too), and convert that one back")
    if isinstance(model, FP8Block):
        return model.to_timm()
    checkpointing = any(m.grad_checkpointing for m in model.modules() if isinstance(m, FP8Block)) or any(
        isinstance(vars(m).get("forward"), _CheckpointedForward) for m in model.modules())
    set_grad_checkpointing(model, False)
    new = {fqn: mod.to_timm() for fqn, mod in model.named_modules() if isinstance(mod, FP8Block)}
    for fqn, block in new.items():
        _swap(model, fqn, block)
    swapped = [(fqn, mod) for fqn, mod in model.named_modules() if is_swapped(mod)]
    for fqn, mod in swapped:
        parent, name = _parent(model, fqn)
        setattr(parent, name, to_torch_linear(mod))
        restore_owner(mod, parent)
    forget_summary(model)
    if isinstance(vars(model).get("set_grad_checkpointing"), _SetGradCheckpointing):
        del model.set_grad_checkpointing  # back to the class's own method
        if checkpointing:
            model.set_grad_checkpointing(True)
    return model


def set_block_fp8(model: nn.Module, names: "str | Sequence[str]", enabled: bool) -> List[str]:
    """Turn FP8 on or off for the named modules of ``model`` (others are untouched).

    A name may be an fp8vit block, a swapped Linear (``fallback="linear"``), or any module holding
    such (then all of those it holds). With FP8 off they run their GEMMs in the autocast dtype
    inside ``fp8_context``.

    Args:
        model: a converted model.
        names: one block's name (``"blocks.0"``) or a sequence of them, as in ``model.named_modules()``.
        enabled: FP8 on (True) or off (False) for those blocks.

    Returns:
        the names, as a list.

    Raises:
        TypeError: ``model`` is not a module, ``names`` neither a str nor a sequence of them,
            ``enabled`` not a bool.
        ValueError: a name that is none of these in ``model``; nothing is changed then.
    """
    fn = "set_block_fp8"
    _check_model(fn, model)
    # a str is one name, not its characters
    names = [names] if isinstance(names, str) else check_items(fn, "names", names, str, "module names (str)")
    check_bool(fn, "enabled", enabled)
    mods = dict(model.named_modules())
    targets, bad = [], []
    for n in names:
        mod = mods.get(n)
        inner = [] if mod is None else [m for m in mod.modules() if isinstance(m, FP8Block) or is_swapped(m)]
        if inner:
            targets.extend(inner)
        else:
            bad.append(n)
    if bad:
        known = [n for n, m in mods.items() if isinstance(m, FP8Block) or is_swapped(m)]
        if not known:
            raise ValueError(f"set_block_fp8: {bad}: this model has no fp8vit blocks or swapped Linears; "
                             "convert it with fp8vit.convert_to_te first")
        listed = ", ".join(known) if len(known) <= 4 else f"{known[0]}, {known[1]}, ..., {known[-1]}"
        raise ValueError(f"set_block_fp8: {bad} are not fp8vit blocks (TE_Block, ...), swapped Linears or "
                         f"modules holding them in this model; its {len(known)} are {listed} "
                         "(fp8vit.conversion_summary(model) lists what was converted)")
    for mod in targets:
        mod.fp8_enabled = enabled
    return names


def set_grad_checkpointing(model: nn.Module, enable: bool = True) -> nn.Module:
    """Activation checkpointing for every block of a converted ``model``.

    fp8vit's blocks checkpoint themselves through TE's checkpoint, which restores the FP8 state on
    recompute (timm's ``checkpoint_seq`` recomputes outside the FP8 autocast, and TE then saves a
    different set of tensors: "a different number of tensors was saved"). The other blocks
    (timm blocks kept by ``module_filter_fn`` or the fallback, and blocks whose Linears were
    swapped) checkpoint themselves too, each as a whole (the innermost blocks holding Linears),
    with TE's checkpoint where they hold TE Linears and torch's otherwise, since timm's own
    checkpointing must stay off around TE modules.

    Args:
        model: a converted model.
        enable: True to checkpoint, False to stop.

    Returns:
        ``model``.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``, or ``enable`` not a bool.
    """
    _check_model("set_grad_checkpointing", model)
    check_bool("set_grad_checkpointing", "enable", enable)
    for mod in model.modules():
        if isinstance(vars(mod).get("forward"), _CheckpointedForward):
            del mod.forward
        if isinstance(mod, FP8Block):
            mod.grad_checkpointing = enable
    if enable:
        for mod in _checkpoint_units(model):
            mod.forward = _CheckpointedForward(mod)
    return model


def _checkpoint_units(model: nn.Module) -> List[nn.Module]:
    """The blocks other than fp8vit's that checkpoint themselves (:func:`set_grad_checkpointing`):
    blocks (``fp8vit.linear.is_block``, or of a family) that hold Linears and no other block."""
    units: List[nn.Module] = []

    def visit(mod: nn.Module, root: bool) -> bool:  # True: mod is or holds a block
        if isinstance(mod, FP8Block):
            return True
        nested = False
        for child in mod.children():
            nested |= visit(child, False)
        block = fp8vit_block_for(mod) is not None or is_block(mod, root)
        if block and not nested and _holds_linear(mod):
            units.append(mod)
        return nested or block

    visit(model, True)
    return units


def set_mlp_recompute(model: nn.Module, enable: bool = True, *, every: int = 1,
                      module_filter_fn: Optional[ModuleFilter] = None) -> nn.Module:
    """Recompute the MLP activations of fp8vit's blocks (``TE_Block``, ...) in backward instead of saving them.

    Selective activation checkpointing: the MLP's saved activations (fc1's output and the
    activation's, ``[B, N, 4C]`` each) are most of a block's. With TE's fused ``LayerNormMLP`` this is
    TE's own ``checkpoint=True`` (LayerNorm, fc1 and the activation rerun in backward, with the
    forward's FP8 scales; fc2 is not rerun). Memory and time scale with the number of blocks chosen,
    so a subset trades between the two (``every=2``: blocks 0, 2, 4, ...). :func:`make_graphed_blocks` captures it with
    the blocks when the MLP is TE's fused one. Measured on ViT-H/16, blocks graphed with cuDNN
    LayerNorm (H200, docs/performance.md, levers 14 and 15): the largest batch grows from 576 images
    to 768 with every second block (592 to 784 with ``fused_wgrad=False``, +5% step time) and to 1120
    with all (+10%, ``fused_wgrad=False``). Blocks whose whole forward
    is checkpointed (:func:`set_grad_checkpointing`) ignore it.

    Args:
        model: a converted model.
        enable: True to recompute, False to save the activations again.
        every: change every ``every``-th of the chosen fp8vit blocks, in model order, starting
            with the first (1: all of them; 2: the 1st, 3rd, 5th, ...).
        module_filter_fn: ``fn(module, fqn) -> bool``; only fp8vit blocks for which it returns
            True are chosen (None: all of them).

    Returns:
        ``model``.

    Raises:
        TypeError: ``model`` is not a module, ``enable`` not a bool, ``every`` not an integer,
            ``module_filter_fn`` not callable.
        ValueError: ``every`` is below 1, ``model`` has no fp8vit block, or ``module_filter_fn``
            selects none of them.
    """
    fn = "set_mlp_recompute"
    _check_model(fn, model)
    check_bool(fn, "enable", enable)
    check_int(fn, "every", every, min=1, hint="(1: every chosen block, 2: every second, ...)")
    _check_filter(fn, module_filter_fn)
    blocks = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, FP8Block)]
    if not blocks:
        raise ValueError(f"set_mlp_recompute: {type(model).__name__} has no fp8vit block (TE_Block, ...); "
                         "run fp8vit.convert_to_te(model) first (swapped Linears have no MLP to recompute)")
    chosen = [m for fqn, m in blocks if module_filter_fn is None or module_filter_fn(m, fqn)]
    if not chosen:
        raise ValueError(f"set_mlp_recompute: module_filter_fn selected none of the {len(blocks)} fp8vit blocks "
                         f"({blocks[0][0]} ... {blocks[-1][0]}); it must return True for the blocks to change")
    for blk in chosen[::every]:
        blk.recompute_mlp = enable
    return model


class _CheckpointedForward:
    """The ``forward`` of a block other than fp8vit's, with activation checkpointing: TE's
    checkpoint where the block holds TE's swapped Linears (it restores their FP8 state on
    recompute), torch's otherwise. An object, not a closure, so that the model still pickles."""

    def __init__(self, block: nn.Module):
        self.block = block
        self.te = any(isinstance(m, _te.SwappedLinear) for m in block.modules())

    def __call__(self, *args, **kwargs):
        forward = type(self.block).forward
        if not torch.is_grad_enabled():
            return forward(self.block, *args, **kwargs)
        if self.te:
            return _te.checkpoint(forward, self.block, *args, **kwargs)
        return torch.utils.checkpoint.checkpoint(forward, self.block, *args, use_reentrant=False, **kwargs)


class _SetGradCheckpointing:
    """``model.set_grad_checkpointing`` of a converted timm model: the class's own method for the
    other parts (e.g. the patch embedding), with timm's own checkpointing kept off around the
    blocks (``checkpoint_seq`` over ``blocks``, a Swin stage's flag), then
    :func:`set_grad_checkpointing` for the blocks. An object, not a closure, so the model pickles."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, enable: bool = True) -> None:
        check_bool("set_grad_checkpointing", "enable", enable)  # before the class's method changes anything
        type(self.model).set_grad_checkpointing(self.model, enable)
        blocks = {id(m) for m in self.model.modules() if isinstance(m, FP8Block)}
        blocks |= {id(m) for m in _checkpoint_units(self.model)}
        for mod in self.model.modules():
            if (not isinstance(mod, FP8Block) and isinstance(vars(mod).get("grad_checkpointing"), bool)
                    and any(id(m) in blocks for m in mod.modules())):
                mod.grad_checkpointing = False
        set_grad_checkpointing(self.model, enable)


def _install_checkpointing(model: nn.Module) -> None:
    """Route ``model.set_grad_checkpointing`` to the blocks' own checkpointing (see above)."""
    if getattr(type(model), "set_grad_checkpointing", None) is None or "set_grad_checkpointing" in vars(model):
        return
    model.set_grad_checkpointing = _SetGradCheckpointing(model)
    # A model converted while checkpointing was on keeps it, now through TE.
    if getattr(model, "grad_checkpointing", False):
        model.set_grad_checkpointing(True)
