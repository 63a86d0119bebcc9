"""Parameter layouts of fp8vit's blocks: timm <-> TE, both directions, bit for bit.

A block's layout is a list of :class:`Tie`\\ s, one per TE tensor. A tie says how that tensor is
made of timm tensors: the concatenation along ``dim`` of slices (:class:`Part`) of timm tensors,
each slice followed by ``pad`` zeros along ``dim``. That one form covers every mapping fp8vit needs:

=====================================  ============================================================
a renaming                             one part, the whole timm tensor (``rename``)
SwiGLU's ``fc1_g``, ``fc1_x``          two timm tensors, one TE ``fc1`` (gate first: TE activates
                                       the first half)
GluMlp's ``fc1`` with ``gate_last``    two slices of one timm tensor, in the other order
hidden widths padded for FP8           ``pad`` zero rows (``fc1``) or columns (``fc2``, ``dim=1``)
=====================================  ============================================================

Converting copies bits only (``cat``, ``narrow``, zeros), so a round trip is exact. TE -> timm
checks that the padding is still zero: a padded unit that is not zero changes what the block
computes, and dropping it silently would change the model.

``TE_Block`` keeps timm's QKV row order, ``(3, heads, head_dim)``: it composes TE's modules
itself and splits q, k, v the way timm does, so no weight is permuted. TE's ``TransformerLayer``,
by contrast, interleaves QKV as ``(heads, 3, head_dim)`` by default. The norms are fused into the
GEMM that follows them: timm's ``norm1`` becomes ``qkv.layer_norm_*`` and ``norm2`` the MLP's
``layer_norm_*``.

The functions take a layout as a sequence of ties, or as a block config that has one (its
``ties()``: :meth:`fp8vit.blocks.config.BlockConfig.ties`, :meth:`fp8vit.blocks.eva.EvaBlockConfig.ties`).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Dict, Iterable, List, Mapping, Optional, Protocol, Sequence, Tuple, Union

import torch

__all__ = ["Part", "Tie", "rename", "name_pairs", "timm_to_te", "te_to_timm",
           "te_requires_grad", "timm_requires_grad", "copy_requires_grad", "is_sharded",
           "block_from_timm", "load_timm_state", "timm_block_of"]

_EXTRA = "_extra_state"


@dataclasses.dataclass(frozen=True)
class Part:
    """A slice ``[start, start + length)`` along the tie's ``dim`` of the timm tensor ``name``.

    ``length=None`` means to the end; with ``start=0``, the whole tensor. ``name=None`` is a block
    of ``length`` zeros that timm has no tensor for (EVA's k bias, held at zero in TE's fused
    ``[q; k; v]`` bias); converting back checks that it is still zero.
    """

    name: Optional[str]
    start: int = 0
    length: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class Tie:
    """TE tensor ``te`` = ``cat([part_0, zeros(pad), part_1, zeros(pad), ...], dim)``.

    Attributes:
        te: the TE parameter name.
        parts: the timm slices, in TE's order. Parts with ``length=None`` in a tie of several
            parts share the TE tensor equally.
        dim: the dimension the parts are concatenated (and padded) along.
        pad: zeros after each part along ``dim`` (hidden units padded for FP8).
    """

    te: str
    parts: Tuple[Part, ...]
    dim: int = 0
    pad: int = 0


class HasTies(Protocol):
    """A block config that knows its layout (``BlockConfig``, ``EvaBlockConfig``)."""

    def ties(self) -> List[Tie]: ...


Layout = Union[HasTies, Sequence[Tie]]


def rename(timm_name: str, te_name: str) -> Tie:
    """The tie of a tensor that only changes name."""
    return Tie(te_name, (Part(timm_name),))


def _ties(layout: Layout) -> Tuple[Tie, ...]:
    return tuple(layout.ties()) if hasattr(layout, "ties") else tuple(layout)


def name_pairs(layout: Layout) -> List[Tuple[str, str]]:
    """``(timm name, TE name)`` for every timm tensor: the TE tensor that holds it (whole, or as
    a part of a concatenation or padded tensor: see :func:`timm_to_te`)."""
    pairs = {}
    for tie in _ties(layout):
        for p in _named(tie.parts):
            pairs.setdefault(p.name, tie.te)
    return list(pairs.items())


def _named(parts: Sequence[Part]) -> List[Part]:
    """The parts that are timm tensors (not zero blocks)."""
    return [p for p in parts if p.name is not None]


def _check_keys(sd_keys: Iterable[str], expected: Iterable[str], what: str) -> None:
    keys = {k for k in sd_keys if not k.endswith(_EXTRA)}
    expected = set(expected)
    missing, unexpected = sorted(expected - keys), sorted(keys - expected)
    if missing or unexpected:
        raise ValueError(f"{what}: state dict does not match the block config: missing {missing}, "
                         f"unexpected {unexpected}")


def _part_lengths(tie: Tie, te_size: int) -> List[int]:
    """The length along ``tie.dim`` of each part, given the TE tensor's size there."""
    n_open = sum(p.length is None for p in tie.parts)
    rest = te_size - sum(p.length for p in tie.parts if p.length is not None) - tie.pad * len(tie.parts)
    if rest < 0 or (n_open == 0 and rest) or (n_open and rest % n_open):
        raise ValueError(f"{tie.te}: size {te_size} along dim {tie.dim} does not hold the parts "
                         f"{[p.name for p in tie.parts]} with {tie.pad} padding after each")
    return [p.length if p.length is not None else rest // n_open for p in tie.parts]


def timm_to_te(sd: Mapping[str, torch.Tensor], layout: Layout) -> Dict[str, torch.Tensor]:
    """A timm state dict (keys relative to the block) -> TE names and layout.

    Renamed tensors are passed through (no copy); concatenated or padded ones are new tensors.

    Raises:
        ValueError: keys missing or left over for ``layout``, listed.
    """
    ties = _ties(layout)
    _check_keys(sd, (p.name for t in ties for p in _named(t.parts)), "timm -> TE")
    out = {}
    for tie in ties:
        pieces = []
        like = sd[_named(tie.parts)[0].name]
        for p in tie.parts:
            if p.name is None:
                shape = list(like.shape)
                shape[tie.dim] = p.length
                pieces.append(like.new_zeros(shape))
                continue
            t = sd[p.name]
            length = t.shape[tie.dim] - p.start if p.length is None else p.length
            pieces.append(t.narrow(tie.dim, p.start, length))
            if tie.pad:
                shape = list(t.shape)
                shape[tie.dim] = tie.pad
                pieces.append(t.new_zeros(shape))
        out[tie.te] = pieces[0] if len(pieces) == 1 and pieces[0].shape == like.shape \
            else torch.cat(pieces, tie.dim)
    return out


def te_to_timm(sd: Mapping[str, torch.Tensor], layout: Layout) -> Dict[str, torch.Tensor]:
    """A TE state dict -> timm names and layout. FP8 scaling state (``*._extra_state``) has no
    timm counterpart and is not carried over. Slices are copied (a view would drag the whole TE
    tensor into a saved checkpoint).

    Raises:
        ValueError: keys missing or left over for ``layout``, listed; or padding that is not zero
            (then the TE block computes something its timm counterpart cannot), named.
    """
    ties = _ties(layout)
    _check_keys(sd, (t.te for t in ties), "TE -> timm")
    pieces: Dict[str, List[Tuple[int, int, torch.Tensor]]] = {}
    for tie in ties:
        t = sd[tie.te]
        offset = 0
        for p, length in zip(tie.parts, _part_lengths(tie, t.shape[tie.dim])):
            piece = t.narrow(tie.dim, offset, length)
            if p.name is None:
                if bool(piece.any()):
                    raise ValueError(f"TE -> timm: {tie.te}[{offset}:{offset + length}] along dim {tie.dim} "
                                     "is not zero; timm has no tensor for it (EVA's k bias) and it is held "
                                     "at zero in training: something wrote to it")
                offset += length + tie.pad
                continue
            if tie.pad and bool(t.narrow(tie.dim, offset + length, tie.pad).any()):
                raise ValueError(f"TE -> timm: the padding of {tie.te} (after {p.name}) is not zero; "
                                 "padded hidden units must stay zero (they are, under fp8vit's init, "
                                 "loading and any gradient-based optimizer): something wrote to them")
            pieces.setdefault(p.name, []).append((p.start, tie.dim, piece))
            offset += length + tie.pad
    out = {}
    for name, ps in pieces.items():
        ps.sort(key=lambda e: e[0])
        dim = ps[0][1]
        ends = [0] + [e[0] + e[2].shape[dim] for e in ps[:-1]]
        if [e[0] for e in ps] != ends:  # a layout bug, not a user error: the parts must tile
            raise ValueError(f"TE -> timm: the parts of {name} do not tile it: starts "
                             f"{[e[0] for e in ps]}, lengths {[e[2].shape[dim] for e in ps]}")
        if len(ps) == 1 and ps[0][2].shape == sd[_holder(ties, name)].shape:
            out[name] = ps[0][2]  # a renaming: the tensor itself, as before
        else:
            out[name] = torch.cat([e[2] for e in ps], dim) if len(ps) > 1 else ps[0][2].clone()
    return out


def _holder(ties: Sequence[Tie], timm_name: str) -> str:
    return next(t.te for t in ties if any(p.name == timm_name for p in _named(t.parts)))


def te_requires_grad(flags: Mapping[str, bool], layout: Layout) -> Dict[str, bool]:
    """``requires_grad`` per timm tensor -> per TE tensor.

    Raises:
        ValueError: timm tensors that TE holds as one tensor disagree, named (a TE tensor is
            trained or frozen as a whole).
    """
    out = {}
    for tie in _ties(layout):
        got = {p.name: bool(flags[p.name]) for p in _named(tie.parts) if p.name in flags}
        if len(set(got.values())) > 1:
            raise ValueError(f"requires_grad differs among {got}, which TE holds as one tensor "
                             f"{tie.te!r}: freeze all of them or none")
        if got:
            out[tie.te] = next(iter(got.values()))
    return out


def timm_requires_grad(flags: Mapping[str, bool], layout: Layout) -> Dict[str, bool]:
    """``requires_grad`` per TE tensor -> per timm tensor (each part takes its TE tensor's)."""
    return {p.name: bool(flags[t.te]) for t in _ties(layout) if t.te in flags for p in _named(t.parts)}


def copy_requires_grad(src, dst, convert, layout: Layout) -> None:
    """Carry frozen parameters over a conversion: ``convert`` (:func:`te_requires_grad` or
    :func:`timm_requires_grad`) maps the ``requires_grad`` flags of ``src``'s parameters to names of
    ``dst``'s (raising where parts of one tensor disagree), which are set."""
    flags = {n: p.requires_grad for n, p in src.named_parameters()}
    dst_params = dict(dst.named_parameters())
    for name, flag in convert(flags, layout).items():
        dst_params[name].requires_grad_(flag)


# --------------------------------------------------------------- blocks built from a timm skeleton
# The EVA-layout families (EVA, BEiT, Swin) and ConvNeXt keep the timm block on the meta device
# (``_timm_skeleton``: its shapes and options, no data) and their ``cfg.ties()`` layout; these three
# are their from_timm, load_timm_state_dict and to_timm.
def block_from_timm(cls, block, cfg, ref: torch.Tensor, **kwargs):
    """``cls(cfg, timm_skeleton=<block on the meta device>, **kwargs)`` on ``ref``'s device and dtype,
    holding timm ``block``'s weights, ``requires_grad`` flags and mode."""
    new = cls(cfg, timm_skeleton=copy.deepcopy(block).to("meta"), device=ref.device, dtype=ref.dtype, **kwargs)
    load_timm_state(new, block.state_dict())
    copy_requires_grad(block, new, te_requires_grad, cfg.ties())
    return new.train(block.training)


def load_timm_state(te_block, sd: Mapping[str, torch.Tensor]) -> None:
    """Load a timm block's state dict (keys relative to the block) into ``te_block`` exactly.

    Raises:
        ValueError: keys that do not match ``te_block``'s configuration, listed.
    """
    res = te_block.load_state_dict(timm_to_te(sd, te_block.cfg.ties()), strict=False)
    missing = [k for k in res.missing_keys if not k.endswith(_EXTRA)]
    if missing or res.unexpected_keys:
        raise ValueError(f"{type(te_block).__name__}: tensors not set {missing}, unknown {res.unexpected_keys}")


def timm_block_of(te_block, ref: torch.Tensor):
    """The timm block ``te_block`` was built from, on ``ref``'s device, with its weights,
    ``requires_grad`` flags and mode; the buffers timm does not save rebuilt as timm builds them
    (``init_non_persistent_buffers``). FP8 scaling state is dropped."""
    block = copy.deepcopy(te_block._timm_skeleton).to_empty(device=ref.device)
    block.load_state_dict(te_to_timm(te_block.state_dict(), te_block.cfg.ties()), strict=True)
    for m in block.modules():
        init = getattr(m, "init_non_persistent_buffers", None)
        if init is not None:
            init()
    copy_requires_grad(te_block, block, timm_requires_grad, te_block.cfg.ties())
    return block.train(te_block.training)


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``DTensor`` shard (FSDP2's ``fully_shard`` parameters): what conversion
    back to timm and CUDA-graph capture refuse."""
    if not torch.distributed.is_available():  # torch built without distributed: no DTensor, no FSDP2
        return False
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)
