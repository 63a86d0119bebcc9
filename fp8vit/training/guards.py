"""Training guard: skip steps whose loss or gradients are not finite, and name the block at fault.

    guard = fp8vit.NonFiniteGuard(model, optimizer)
    for x, y in loader:
        with fp8vit.fp8_context():
            loss = criterion(model(x), y)
        loss.backward()
        guard.step(loss)            # optimizer.step() + zero_grad(), or a skip with a report

A skipped step leaves parameters and optimizer state (momentum, Adam moments, step counts)
untouched: the optimizer is simply not stepped and the gradients are dropped.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Dict, List, Optional

import torch
from torch import nn

from .. import _te
from .._validate import check_bool, check_int, check_type
from ..blocks.base import FP8Block

__all__ = ["NonFiniteGuard", "NonFiniteEvent"]


@dataclasses.dataclass(frozen=True)
class NonFiniteEvent:
    """One skipped step.

    Attributes:
        step: index of the ``guard.step`` call (0-based).
        loss: the loss value (may be inf or nan).
        first_bad_activation: the first block, in forward order, whose output was not finite
            (None if all block outputs were finite).
        first_bad_gradient: the first block, in backward order, with non-finite weight gradients:
            where the backward pass went wrong (if the forward did not already).
        bad_grads: blocks with non-finite weight gradients, in model order.
        other_bad_grads: parameters outside the blocks with non-finite gradients.
    """

    step: int
    loss: float
    first_bad_activation: Optional[str]
    first_bad_gradient: Optional[str]
    bad_grads: List[str]
    other_bad_grads: List[str]

    def __str__(self) -> str:
        where = (f"first non-finite activation in {self.first_bad_activation}"
                 if self.first_bad_activation else "all block activations finite")
        if self.first_bad_gradient:
            where += f"; backward first non-finite in {self.first_bad_gradient}"
        return (f"step {self.step}: skipped (loss {self.loss}); {where}; non-finite weight gradients in "
                f"{self.bad_grads or 'no block'}" + (f" and {self.other_bad_grads}" if self.other_bad_grads else ""))


def _default_blocks(model: nn.Module) -> Dict[str, nn.Module]:
    blocks = getattr(model, "blocks", None)
    # timm's VisionTransformer holds its blocks in an nn.Sequential, Eva (EVA02, the RoPE ViTs, PE)
    # in an nn.ModuleList: both, so that a block kept as timm's (module_filter_fn) is watched too.
    if isinstance(blocks, (nn.Sequential, nn.ModuleList)):
        return {f"blocks.{i}": b for i, b in enumerate(blocks)}
    return {n: m for n, m in model.named_modules() if isinstance(m, FP8Block)}


class NonFiniteGuard:
    """Steps ``optimizer`` only when the loss and every gradient are finite.

    With gradient accumulation, call ``step`` once per optimizer step (after the last
    micro-batch's ``backward``, with that micro-batch's loss): the block flags cover every
    forward since the previous ``step``.

    Args:
        model: the model being trained.
        optimizer: its optimizer.
        blocks: ``{name: module}`` to attribute problems to; default every block of ``model.blocks``
            (timm's ViTs and EVA models, converted or not) or, without it, every fp8vit block
            (``TE_Block``, ...).
        max_consecutive: raise ``RuntimeError`` after this many skipped steps in a row (None: never).
        repair_fp8_state: on a skip, replace non-finite values in TE delayed-scaling amax histories by
            zero, so one bad step does not freeze the FP8 scales for the whole history length.

    Raises:
        TypeError: ``model`` is not a module, ``optimizer`` not a ``torch.optim.Optimizer``,
            ``blocks`` not a dict of modules, ``max_consecutive`` not an integer,
            ``repair_fp8_state`` not a bool.
        ValueError: ``max_consecutive`` below 0.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 blocks: Optional[Dict[str, nn.Module]] = None, max_consecutive: Optional[int] = None,
                 repair_fp8_state: bool = True) -> None:
        fn = "NonFiniteGuard"
        check_type(fn, "model", model, nn.Module, "a torch.nn.Module")
        check_type(fn, "optimizer", optimizer, torch.optim.Optimizer, "a torch.optim.Optimizer")
        check_type(fn, "blocks", blocks, Mapping, "a dict {name: module}", none_ok=True)
        for name, block in (blocks or {}).items():
            check_type(fn, f"blocks[{name!r}]", block, nn.Module, "a torch.nn.Module")
        check_int(fn, "max_consecutive", max_consecutive, min=0, none_ok=True)
        check_bool(fn, "repair_fp8_state", repair_fp8_state)
        self.model, self.optimizer = model, optimizer
        self.blocks = blocks if blocks is not None else _default_blocks(model)
        self.max_consecutive, self.repair_fp8_state = max_consecutive, repair_fp8_state
        self.events: List[NonFiniteEvent] = []
        self.steps = self.consecutive = 0
        self._order: List[str] = []
        self._finite: Dict[str, torch.Tensor] = {}
        block_params = {id(p) for b in self.blocks.values() for p in b.parameters()}
        self._other = [(n, p) for n, p in model.named_parameters() if id(p) not in block_params]
        self._hooks = [b.register_forward_hook(self._record(n)) for n, b in self.blocks.items()]

    def _record(self, name: str):
        def hook(module, args, out):
            if torch.is_grad_enabled():  # training forward; a flag on the device, read only on a skip
                finite = torch.isfinite(out.detach()).all()
                if name in self._finite:  # another micro-batch of the same step: any bad one counts
                    self._finite[name] = self._finite[name] & finite
                else:
                    self._order.append(name)
                    self._finite[name] = finite
        return hook

    def remove(self) -> None:
        """Detach the guard's hooks from the model."""
        for h in self._hooks:
            h.remove()

    @property
    def skipped(self) -> int:
        return len(self.events)

    def step(self, loss: torch.Tensor) -> bool:
        """``optimizer.step()`` and ``zero_grad()`` if everything is finite, else skip and report.

        Returns:
            True if the optimizer stepped.
        """
        grads = [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        flags = [torch.isfinite(loss.detach()).all()] + [torch.isfinite(g).all() for g in grads]
        ok = bool(torch.stack(flags).all())  # one device sync per step
        if ok:
            self.optimizer.step()
            self.consecutive = 0
        else:
            self._skip(loss)
        self.optimizer.zero_grad(set_to_none=True)
        self._order.clear()
        self._finite.clear()
        self.steps += 1
        return ok

    def _skip(self, loss: torch.Tensor) -> None:
        first = next((n for n in self._order if not bool(self._finite[n])), None)

        def bad(params):
            return any(p.grad is not None and not bool(torch.isfinite(p.grad).all()) for p in params)

        bad_blocks = [n for n, b in self.blocks.items() if bad(b.parameters())]
        event = NonFiniteEvent(
            step=self.steps, loss=float(loss.detach()), first_bad_activation=first,
            first_bad_gradient=next((n for n in reversed(self._order) if n in bad_blocks), None),
            bad_grads=bad_blocks,
            other_bad_grads=[n for n, p in self._other if bad([p])])
        self.events.append(event)
        self.consecutive += 1
        if self.repair_fp8_state:
            _te.repair_amax_histories(self.model)
        warnings.warn(f"fp8vit.NonFiniteGuard: {event}", RuntimeWarning, stacklevel=3)
        if self.max_consecutive is not None and self.consecutive > self.max_consecutive:
            raise RuntimeError(f"{self.consecutive} consecutive non-finite steps (max_consecutive="
                               f"{self.max_consecutive}); last: {event}")
