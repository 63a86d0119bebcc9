"""``diagnose``: where in a model does FP8 cost accuracy, measured on one batch.

Runs the same forward/backward twice on the same weights and batch, in bf16 and in FP8, and
compares each fp8vit block's (``TE_Block``, ...) output activations and weight gradients by signal-to-noise ratio.
Blocks below a threshold (or with non-finite values) are recommended to stay in bf16;
:meth:`DiagnosisReport.apply` does that without rebuilding the model.

    report = fp8vit.diagnose(model, images, target=labels, recipe="delayed")
    print(report.table())
    report.apply(model)          # recommended blocks now run their GEMMs in bf16 inside fp8_context
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import _te
from .._validate import check_callable, check_int, check_number, check_type
from .context import fp8_context
from .switches import set_block_fp8
from ..blocks.base import FP8Block
from .numerics import E4M3_MAX, E4M3_TINY, E5M2_MAX, E5M2_TINY, snr_db, underflow_fraction
from .._te.recipes import check_recipe, recipe_name

__all__ = ["diagnose", "DiagnosisReport", "BlockStats", "SCHEMA_VERSION"]

SCHEMA_VERSION = 2  # 2: local_weight_grad_snr_db, which the recommendation uses


@dataclasses.dataclass(frozen=True)
class BlockStats:
    """FP8 vs bf16 for one block.

    Attributes:
        name: the block's path in the model (``blocks.7``).
        local_snr_db: SNR of the block's own FP8 error: its residual update (output - input) in
            FP8 against the same block's update in bf16 on the same (FP8-run) input. The residual
            stream itself passes through unquantized, so it is left out of both. This is what the
            recommendation uses.
        activation_snr_db: SNR of the block's output, FP8 run against bf16 run: its own error
            plus everything upstream.
        weight_grad_snr_db: SNR of all the block's weight gradients together, FP8 run against
            bf16 run (they carry the error of every other block too: downstream through the
            output gradient, upstream through the input).
        local_weight_grad_snr_db: SNR of the block's own weight-gradient error: its FP8 weight
            gradients against the same block's bf16 backward on the same (FP8-run) input and
            output gradient. This is what the recommendation uses, so that one bad block does not
            flag every other block through the gradients it passes on.
        input_amax: max |block input| in the FP8 run.
        input_underflow: fraction of the block input that E4M3 per-tensor scaling flushes to zero.
        grad_underflow: fraction of the gradient at the block output that E5M2 flushes to zero.
        nonfinite: count of inf/nan in the block's output and weight gradients in the FP8 run.
        te_scaling: TE delayed-scaling state per module, ``{module: [amax, scale]}`` of the
            forward input (empty for stateless recipes and the reference backend).
    """

    name: str
    local_snr_db: float
    activation_snr_db: float
    weight_grad_snr_db: float
    local_weight_grad_snr_db: float
    input_amax: float
    input_underflow: float
    grad_underflow: float
    nonfinite: int
    te_scaling: Dict[str, List[float]] = dataclasses.field(default_factory=dict)

    def ok(self, threshold_db: float, grad_threshold_db: float) -> bool:
        """FP8 is acceptable here: finite, local SNR >= ``threshold_db`` and local weight-gradient
        SNR >= ``grad_threshold_db`` (NaN never passes)."""
        return (self.nonfinite == 0 and self.local_snr_db >= threshold_db
                and self.local_weight_grad_snr_db >= grad_threshold_db)


@dataclasses.dataclass(frozen=True)
class DiagnosisReport:
    """The result of :func:`diagnose`; JSON schema version :data:`SCHEMA_VERSION`."""

    recipe: str
    threshold_db: float
    grad_threshold_db: float
    output_snr_db: float
    blocks: tuple

    @property
    def recommend_bf16(self) -> List[str]:
        """Blocks to keep in bf16 at the thresholds, in model order."""
        return [b.name for b in self.blocks if not b.ok(self.threshold_db, self.grad_threshold_db)]

    def module_filter_fn(self) -> Callable[[nn.Module, str], bool]:
        """For ``convert_to_te(model, module_filter_fn=...)``: convert all but the recommended blocks."""
        keep = set(self.recommend_bf16)
        return lambda module, fqn: fqn not in keep

    def apply(self, model: nn.Module) -> List[str]:
        """Run the recommended fp8vit blocks of ``model`` in bf16 (FP8 off for them only).

        Returns:
            the names switched to bf16.
        """
        return set_block_fp8(model, self.recommend_bf16, enabled=False)

    def to_dict(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, "recipe": self.recipe, "threshold_db": self.threshold_db,
                "grad_threshold_db": _json_num(self.grad_threshold_db), "output_snr_db": _json_num(self.output_snr_db), "recommend_bf16": self.recommend_bf16,
                "blocks": [{k: _json_num(v) for k, v in dataclasses.asdict(b).items()} for b in self.blocks]}

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, d: dict) -> "DiagnosisReport":
        if d.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"diagnosis schema_version {d.get('schema_version')!r}; this fp8vit reads "
                             f"{SCHEMA_VERSION}")
        blocks = tuple(BlockStats(**{k: _from_json_num(v) for k, v in b.items()}) for b in d["blocks"])
        return cls(d["recipe"], d["threshold_db"], _from_json_num(d["grad_threshold_db"]),
                   _from_json_num(d["output_snr_db"]), blocks)

    def table(self) -> str:
        head = (f"{'block':14s} {'local dB':>8s} {'act dB':>7s} {'local wgrad':>11s} {'wgrad dB':>8s} {'in amax':>9s} "
                f"{'in uflow':>9s} {'grad uflow':>10s} {'nonfinite':>9s}  verdict")
        lines = [f"FP8 recipe {self.recipe}; keep bf16 below {self.threshold_db:g} dB local SNR or "
                 f"{self.grad_threshold_db:g} dB local weight-gradient SNR; model output SNR "
                 f"{self.output_snr_db:.1f} dB", head, "-" * len(head)]
        for b in self.blocks:
            verdict = "fp8" if b.ok(self.threshold_db, self.grad_threshold_db) else "keep bf16"
            lines.append(f"{b.name:14s} {b.local_snr_db:8.1f} {b.activation_snr_db:7.1f} "
                         f"{b.local_weight_grad_snr_db:11.1f} {b.weight_grad_snr_db:8.1f} {b.input_amax:9.3g} {b.input_underflow:9.2%} "
                         f"{b.grad_underflow:10.2%} {b.nonfinite:9d}  {verdict}")
        rec = self.recommend_bf16
        lines.append(f"recommend bf16 for: {', '.join(rec) if rec else 'none'}")
        return "\n".join(lines)


def _json_num(v):
    """JSON has no inf/nan: write them as strings."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _from_json_num(v):
    return float(v) if v in ("inf", "-inf", "nan") else v


def _one_pass(model, blocks, x, target, loss_fn, recipe, fp8: bool):
    """Forward + backward; returns (output, {block: (input, output, grad_out, weight grads)})."""
    caught: Dict[str, dict] = {n: {} for n in blocks}
    hooks = []
    for name, blk in blocks.items():
        def fwd(mod, args, kwargs, out, name=name):
            # The block's other arguments (an EVA block's rope, timm passes it by keyword; an
            # attention mask) go to every rerun of the block: without them it computes another function.
            call = (args[1:], kwargs)
            caught[name]["input"] = args[0].detach().float()
            caught[name]["output"] = out.detach().float()
            caught[name]["call"] = call
            if fp8:  # the same block on the same input with FP8 off: its own error, isolated
                was, mod.fp8_enabled = mod.fp8_enabled, False
                try:
                    with torch.no_grad():
                        caught[name]["local_ref"] = mod.forward(args[0].detach(), *call[0], **call[1]).float()
                finally:
                    mod.fp8_enabled = was

        def bwd(mod, grad_in, grad_out, name=name):
            caught[name]["grad_out"] = grad_out[0].detach().float()

        hooks += [blk.register_forward_hook(fwd, with_kwargs=True), blk.register_full_backward_hook(bwd)]
    try:
        model.zero_grad(set_to_none=True)
        x = x.detach().requires_grad_(True)  # so backward hooks fire on the first block too
        with fp8_context(recipe, enabled=fp8, strict=fp8):
            out = model(x)
            loss = loss_fn(out, target)
        loss.backward()
    finally:
        for h in hooks:
            h.remove()
    for name, blk in blocks.items():
        params = _trainable(blk)
        caught[name]["wgrad"] = _flat(params, [p.grad for p in params])
    model.zero_grad(set_to_none=True)
    return out.detach().float(), caught


def _trainable(blk: nn.Module) -> List[nn.Parameter]:
    return [p for p in blk.parameters() if p.requires_grad]


def _flat(params, grads) -> torch.Tensor:
    """``grads`` of ``params`` as one fp32 vector (a None gradient counts as zeros)."""
    return torch.cat([(torch.zeros_like(p) if g is None else g).detach().float().flatten()
                      for p, g in zip(params, grads)])


def _local_weight_grads(blk: FP8Block, x: torch.Tensor, grad_out: torch.Tensor, recipe,
                        call: tuple) -> torch.Tensor:
    """``blk``'s weight gradients with FP8 off, on the FP8 run's block input ``x`` and output
    gradient ``grad_out``: the reference for the block's own weight-gradient error. ``call``: the
    block's other arguments in the model's forward, ``(args, kwargs)`` (an EVA block's ``rope``,
    an attention mask)."""
    params = _trainable(blk)
    args, kwargs = call
    with fp8_context(recipe, enabled=False, strict=False):
        out = blk(x.detach(), *args, **kwargs)
    return _flat(params, torch.autograd.grad(out, params, grad_out.to(out.dtype), allow_unused=True))


def _default_loss(out, target):
    if target is None:
        return out.float().square().mean()
    return F.cross_entropy(out.float(), target)


def diagnose(
    model: nn.Module,
    batch: torch.Tensor,
    *,
    target: Optional[torch.Tensor] = None,
    loss_fn: Optional[Callable] = None,
    recipe=None,
    threshold_db: float = 20.0,
    grad_threshold_db: float = 12.0,
    warmup: int = 2,
) -> DiagnosisReport:
    """Compare one FP8 forward/backward with bf16, per fp8vit block (``TE_Block``, ...).

    Weights are not changed (no optimizer step); gradients are cleared afterwards. With delayed
    scaling the first FP8 passes only fill the amax history, hence ``warmup`` FP8 passes first.

    Args:
        model: a model containing fp8vit blocks (after ``convert_to_te``), in train or eval mode
            (eval gives deterministic dropout).
        batch: the input, e.g. images ``[B, 3, H, W]``.
        target: labels for the default cross-entropy loss; None uses ``mean(output^2)``.
        loss_fn: ``loss_fn(output, target) -> scalar`` instead of the default.
        recipe: FP8 recipe name or TE recipe object (None: the GPU's default).
        threshold_db: blocks whose local (own) activation SNR is below this stay bf16. 20 dB:
            noise power 1% of the signal.
        grad_threshold_db: ... or whose weight-gradient SNR is below this. 12 dB: gradients are
            E5M2 (2 mantissa bits), see docs/numerics.md.
        warmup: FP8 passes before the measured one.

    Raises:
        TypeError: ``model`` is not a module, ``batch`` (or ``target``) not a tensor, ``loss_fn``
            not callable, ``recipe`` neither a name nor a TE recipe object, a threshold not a
            number, ``warmup`` not an integer.
        ValueError: an unknown ``recipe`` name, a NaN threshold, ``warmup`` below 0, or the model
            has no fp8vit block.
        FP8UnavailableError: FP8 cannot run here (the reason is in the message).
    """
    fn = "diagnose"
    check_type(fn, "model", model, nn.Module, "a torch.nn.Module")
    check_type(fn, "batch", batch, torch.Tensor, "a torch.Tensor (the model's input)")
    check_type(fn, "target", target, torch.Tensor, "a torch.Tensor (labels)", none_ok=True)
    check_callable(fn, "loss_fn", loss_fn, "a callable loss_fn(output, target)", none_ok=True)
    check_recipe(fn, recipe)
    check_number(fn, "threshold_db", threshold_db)
    check_number(fn, "grad_threshold_db", grad_threshold_db)
    check_int(fn, "warmup", warmup, min=0)
    blocks = {n: m for n, m in model.named_modules() if isinstance(m, FP8Block)}
    if not blocks:
        raise ValueError("diagnose: the model has no fp8vit block (TE_Block, ...); run fp8vit.convert_to_te(model) "
                         "first (blocks whose Linears were swapped are not diagnosed)")
    loss_fn = loss_fn or _default_loss
    ref_out, ref = _one_pass(model, blocks, batch, target, loss_fn, recipe, fp8=False)
    for _ in range(warmup):
        _one_pass(model, blocks, batch, target, loss_fn, recipe, fp8=True)
    out, got = _one_pass(model, blocks, batch, target, loss_fn, recipe, fp8=True)
    stats = []
    for name, blk in blocks.items():
        r, g = ref[name], got[name]
        nonfinite = int((~torch.isfinite(g["output"])).sum() + (~torch.isfinite(g["wgrad"])).sum())
        local_wgrad = (_local_weight_grads(blk, g["input"], g["grad_out"], recipe, g["call"])
                       if "grad_out" in g else torch.full_like(g["wgrad"], math.nan))
        stats.append(BlockStats(
            name=name,
            local_snr_db=snr_db(g["local_ref"] - g["input"], g["output"] - g["input"]),
            activation_snr_db=snr_db(r["output"], g["output"]),
            weight_grad_snr_db=snr_db(r["wgrad"], g["wgrad"]),
            local_weight_grad_snr_db=snr_db(local_wgrad, g["wgrad"]),
            input_amax=float(g["input"].abs().max()),
            input_underflow=underflow_fraction(g["input"], E4M3_MAX, E4M3_TINY),
            grad_underflow=underflow_fraction(g.get("grad_out", torch.zeros(1)), E5M2_MAX, E5M2_TINY),
            nonfinite=nonfinite,
            te_scaling=_te.scaling_state(blk),
        ))
    name = recipe if isinstance(recipe, str) else (recipe_name(recipe) if recipe is not None else "default")
    return DiagnosisReport(recipe=name, threshold_db=threshold_db, grad_threshold_db=grad_threshold_db,
                           output_snr_db=snr_db(ref_out, out),
                           blocks=tuple(stats))
