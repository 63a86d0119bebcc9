"""What ``convert_to_te`` made of a model: the blocks it fused, the Linears it swapped for FP8
Linears, what it kept as it was and why, and the Linears outside every block.

    fp8vit.convert_to_te(model, fallback="linear")
    print(fp8vit.conversion_summary(model))
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional, Tuple

from torch import nn

from ._validate import check_type
from .blocks.compiled import is_compiled_block
from .blocks.model_norm import AutocastLayerNorm, AutocastTimmLayerNorm, model_norms
from .blocks.patch_embed import PatchGemmConv2d
from .training.autocast import describe_fp8_autocast
from .training.graphs import graphed_handles
from .training.switches import patch_embed_convs

__all__ = ["ConversionSummary", "conversion_summary", "record_summary", "forget_summary", "EXCLUDED"]

# The reason of the modules kept because module_filter_fn said so (no warning for those).
EXCLUDED = "excluded by module_filter_fn"

# Where convert_to_te leaves the summary: an attribute of the converted model (not in its state dict).
_ATTR = "_fp8vit_conversion"

Groups = Tuple[Tuple[str, Tuple[str, ...]], ...]


def _count(groups: Groups) -> int:
    return sum(len(paths) for _, paths in groups)


def _examples(paths: Tuple[str, ...], n: int = 3) -> str:
    shown = ", ".join(p or "<model>" for p in paths[:n])
    return shown + (f", ... (+{len(paths) - n})" if len(paths) > n else "")


@dataclasses.dataclass(frozen=True)
class ConversionSummary:
    """What :func:`fp8vit.convert_to_te` made of a model; ``str()`` gives :meth:`table`.

    Groups are ``((key, (path, ...)), ...)`` in model order; ``dict(summary.kept)`` reads one as a
    dict. Paths are module paths in the model (``""``: the model itself).

    Attributes:
        fallback: the ``fallback`` of the conversion (``"linear"``, ``"keep"``, ``"error"`` or
            ``"compile"``).
        fused: blocks replaced by fp8vit's fused blocks, keyed by fp8vit block class.
        swapped: ``nn.Linear``s swapped for FP8 Linears, keyed by why their block was not fused.
        kept: blocks and Linears left as they are (they run in the autocast dtype), keyed by reason.
        compiled: blocks kept unfused and compiled in place (``fallback="compile"``), keyed by
            why they were not fused.
        outside: the ``nn.Linear``s outside every block (classifier head, embeddings), which
            fp8vit never converts.
        fp8_forward: where the model carries FP8 (:func:`fp8vit.set_fp8_autocast`), in words, as
            :func:`conversion_summary` reads it; None: FP8 runs only inside an ``fp8_context``.
        cuda_graphs: the blocks' CUDA graphs (``cuda_graphs=True``, :func:`fp8vit.make_graphed_blocks`)
            in words, as :func:`conversion_summary` reads them: shapes captured, replays, eager
            calls by reason, memory; None: no graphs.
        model_compiled: the model is compiled around its fused blocks (``compile=True``), as
            :func:`conversion_summary` finds it (False again after a failed compile).
        patch_gemm: the patch-embedding convolutions that run as one GEMM under autocast
            (``patch_gemm``, :func:`fp8vit.set_patch_gemm`), as :func:`conversion_summary` finds them.
        model_norms: the model's own LayerNorms (``norm``, ``fc_norm``, ``norm_pre``) that run as one
            Triton pass each way under autocast (``fp8vit.blocks.model_norm``), as
            :func:`conversion_summary` finds them.
    """

    fallback: str
    fused: Groups = ()
    swapped: Groups = ()
    kept: Groups = ()
    compiled: Groups = ()
    outside: Tuple[str, ...] = ()
    fp8_forward: Optional[str] = None
    cuda_graphs: Optional[str] = None
    model_compiled: bool = False
    patch_gemm: Tuple[str, ...] = ()
    model_norms: Tuple[str, ...] = ()

    @property
    def num_fused(self) -> int:
        """Blocks fused."""
        return _count(self.fused)

    @property
    def num_swapped(self) -> int:
        """Linears swapped for FP8 Linears."""
        return _count(self.swapped)

    @property
    def num_kept(self) -> int:
        """Blocks and Linears kept as they were."""
        return _count(self.kept)

    @property
    def num_compiled(self) -> int:
        """Blocks compiled in place (``fallback="compile"``)."""
        return _count(self.compiled)

    @property
    def unasked_kept(self) -> Groups:
        """The ``kept`` groups other than those ``module_filter_fn`` asked for."""
        return tuple((r, p) for r, p in self.kept if r != EXCLUDED)

    @property
    def compiled_paths(self) -> Tuple[str, ...]:
        """The compiled blocks' paths, group by group."""
        return tuple(p for _, paths in self.compiled for p in paths)

    def counts(self) -> dict:
        """``{"fused": n, "linear": n, "kept": {reason: n}}``: the outcome in numbers (JSON-able)."""
        return {"fused": self.num_fused, "linear": self.num_swapped,
                "kept": {reason: len(paths) for reason, paths in self.kept}}

    def to_dict(self) -> dict:
        """Every field, JSON-able (groups as ``{key: [paths]}``)."""
        return {"fallback": self.fallback, "fused": {k: list(p) for k, p in self.fused},
                "swapped": {k: list(p) for k, p in self.swapped}, "kept": {k: list(p) for k, p in self.kept},
                "compiled": {k: list(p) for k, p in self.compiled},
                "outside": list(self.outside), "fp8_forward": self.fp8_forward, "cuda_graphs": self.cuda_graphs,
                "model_compiled": self.model_compiled, "patch_gemm": list(self.patch_gemm),
                "model_norms": list(self.model_norms)}

    def short(self) -> str:
        """One line: the counts, and every reason for keeping something, with examples."""
        fused = ", ".join(f"{fam} {len(p)}" for fam, p in self.fused)
        line = (f"fp8vit.convert_to_te(fallback={self.fallback!r}): fused {self.num_fused} blocks"
                + (f" ({fused})" if fused else "") + f", swapped {self.num_swapped} Linears for FP8 Linears")
        if self.compiled:
            line += f", compiled {self.num_compiled} blocks it cannot fuse ({_examples(self.compiled_paths, 2)})"
        if self.kept:
            line += f", kept {self.num_kept} modules as they are: " + "; ".join(
                f"{reason}: {len(p)} ({_examples(p, 2)})" for reason, p in self.kept)
        if self.patch_gemm:
            line += "; the patch embedding as one GEMM"
        if self.model_norms:
            line += f"; {_examples(self.model_norms, 2)} in one pass each way"
        if self.fp8_forward:
            line += "; FP8 inside the model's forward"
        if self.cuda_graphs:
            line += "; CUDA-graphed blocks"
        if self.model_compiled:
            line += "; the model compiled around them"
        return line

    def table(self) -> str:
        """Several lines: each group with its count and a few example paths."""
        lines = [f"fp8vit conversion (fallback={self.fallback!r})"]

        def section(title: str, groups: Iterable[Tuple[str, Tuple[str, ...]]], total: int) -> None:
            groups = list(groups)
            lines.append(f"  {title:24s} {total:5d}")
            for key, paths in groups:
                lines.append(f"    {len(paths):5d}  {key}: {_examples(paths)}")

        section("fused fp8vit blocks", self.fused, self.num_fused)
        section("swapped to FP8 Linears", self.swapped, self.num_swapped)
        section("kept as they are", self.kept, self.num_kept)
        if self.compiled:
            section("compiled (torch.compile)", self.compiled, self.num_compiled)
        lines.append(f"  {'Linears outside blocks':24s} {len(self.outside):5d}"
                     + (f"  (never converted: {_examples(self.outside)})" if self.outside else ""))
        lines.append(f"  FP8: {self.fp8_forward or 'inside fp8_context() only (set_fp8_autocast: in the model)'}")
        if self.cuda_graphs:
            lines.append(f"  CUDA graphs: {self.cuda_graphs}")
        if self.model_compiled:
            lines.append("  torch.compile: the model, around the fused blocks (compile=True)")
        if self.patch_gemm:
            lines.append(f"  patch embedding as one GEMM under autocast: {_examples(self.patch_gemm)}")
        if self.model_norms:
            lines.append(f"  the model's norms in one Triton pass each way under autocast: {_examples(self.model_norms)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def record_summary(model: nn.Module, summary: ConversionSummary) -> None:
    """Leave ``summary`` on ``model`` for :func:`conversion_summary` (a plain attribute: it pickles
    with the model and stays out of its state dict)."""
    object.__setattr__(model, _ATTR, summary)


def forget_summary(model: nn.Module) -> None:
    """Drop the summary :func:`record_summary` left on ``model``, if any."""
    vars(model).pop(_ATTR, None)


def conversion_summary(model: nn.Module) -> ConversionSummary:
    """The :class:`ConversionSummary` of the last :func:`fp8vit.convert_to_te` call on ``model``, with
    where FP8 runs now (``fp8_forward``: inside the model, after :func:`fp8vit.set_fp8_autocast`) and
    what its CUDA graphs did so far (``cuda_graphs``), which patch convolutions run as one GEMM
    (``patch_gemm``) and which of its own norms run in one pass (``model_norms``).

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
        ValueError: ``convert_to_te`` was not run on ``model`` (or ``convert_from_te`` undid it).
    """
    check_type("conversion_summary", "model", model, nn.Module, "a torch.nn.Module")
    summary = vars(model).get(_ATTR)
    if summary is None:
        raise ValueError(f"conversion_summary: this {type(model).__name__} was not converted; run "
                         "fp8vit.convert_to_te(model) first (it returns the model and leaves the summary on it)")
    graphs = graphed_handles(model)
    return dataclasses.replace(summary, fp8_forward=describe_fp8_autocast(model),
                               cuda_graphs="; ".join(g.describe() for g in graphs) or None,
                               model_compiled=is_compiled_block(model),
                               patch_gemm=tuple(n for n, conv in patch_embed_convs(model).items()
                                                if isinstance(conv, PatchGemmConv2d)),
                               model_norms=tuple(n for n, norm in model_norms(model).items()
                                                 if isinstance(norm, (AutocastLayerNorm, AutocastTimmLayerNorm))))
