"""TE's graphed forward without its per-call walk over the module tree (lever 41).

Each call of the forward that ``te.make_graphed_callables`` installs on a module (TE 2.20's
``new_fwd`` in ``transformer_engine/pytorch/graph.py``) walks ``module.modules()`` and, for every
TE module the capture visited, sets ``fp8_meta["fp8_group"]`` and ``fp8_meta["recipe"]`` to the
current autocast's and registers its amax tensors for the delayed-scaling reduction (a no-op after
the first call), importing ``DotProductAttention`` inside the loop to skip attention that runs in
bf16. For a whole ViT-B stack that walk is 169 modules and 36 registrations per step, on the host
before the graph's replay: about 290 us on a 2-core CPU (``dev/graph_forward_host_time.py``), which
a synchronized step pays as GPU idle time.

:func:`lean_graphed_forward` returns a callable that does the same per call for a list of those
modules made once (per setting of the recipe's ``fp8_mha``/``fp8_dpa``), in the walk's order,
then calls TE's inner graphed function. It reads TE's forward only where the forward is the one it
was written against (its free variables and the names its code uses): any other TE forward is
returned as it is.

Lever 58: where the graph has one input, :meth:`_LeanForward.launch` replays the forward graph
before that host work (the walk, and autograd's bookkeeping of TE's graphed function over every
parameter), and :meth:`_LeanForward.call_launched` then does it with TE's replay skipped. In a
synchronized step (the host waits for the GPU at each step's end) the GPU starts that much earlier.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, Optional, Tuple

__all__ = ["lean_graphed_forward"]

# TE 2.20's new_fwd: the closure it reads and every global or attribute name its code uses.
_FREEVARS = frozenset({"func", "graph_training_state", "graphed", "helpers", "orig_fwd", "te_modules"})
_NAMES = frozenset({
    "ensure_not_reset", "training", "FP8GlobalStateManager", "is_fp8_enabled", "get_fp8_recipe", "modules",
    "isinstance", "TransformerEngineBaseModule", "transformer_engine.pytorch.attention.dot_product_attention",
    "DotProductAttention", "fp8_mha", "fp8_dpa", "get_fp8_group", "fp8_meta", "add_fp8_tensors_to_global_buffer",
    "BasicOperation", "num_quantizers", "_fp8_metas"})
_DPA_MODULE = "transformer_engine.pytorch.attention.dot_product_attention"
# TE 2.20.2's Graphed.forward (make_graphed_autograd_function): the closure it reads and the names its
# code uses. It copies each user input into the graph's static input unless it is that tensor, then
# replays ``fwd_graph`` (on the current stream without the cuda_graph_stream keyword). TE's
# release_static_state sets the closure's graph and buffers to None: they are read at each call.
_GRAPHED_FREEVARS = frozenset({"ensure_not_reset", "fwd_graph", "len_user_args", "static_input_surface",
                               "static_outputs"})
_GRAPHED_NAMES = frozenset({
    "FP8GlobalStateManager", "Tensor", "TypeError", "__name__", "copy_", "cuda", "cuda_graph_event",
    "cuda_graph_stream", "current_stream", "data_ptr", "is_first_fp8_module", "is_first_module", "isinstance",
    "range", "replay", "set_skip_fp8_weight_update_tensor", "torch", "tuple", "type", "wait_event", "wait_stream"})


def _cells(fn: Any) -> Dict[str, Any]:
    """A function's closure by variable name ({} where it has none)."""
    code, closure = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or closure is None:
        return {}
    out = {}
    for name, cell in zip(code.co_freevars, closure):
        try:
            out[name] = cell.cell_contents
        except ValueError:  # an empty cell
            pass
    return out


def _forward_graph(graphed: Any) -> Optional[Dict[str, Any]]:
    """The closure cells of TE 2.20.2's ``Graphed.forward`` inside its graphed function
    (``functionalized``), by name, where the graph takes one user input; else None."""
    graphed_cls = _cells(graphed).get("Graphed")
    forward = getattr(graphed_cls, "forward", None)
    code = getattr(forward, "__code__", None)
    if code is None or frozenset(code.co_freevars) != _GRAPHED_FREEVARS or frozenset(code.co_names) != _GRAPHED_NAMES:
        return None
    cells = dict(zip(code.co_freevars, forward.__closure__))
    return cells if cells["len_user_args"].cell_contents == 1 else None


def _replayed() -> None:
    """A forward graph's ``replay`` while :meth:`_LeanForward.call_launched` runs: it already ran."""


class _LeanForward:
    """TE's graphed forward for one module, its walk replaced by a list (module docstring)."""

    def __init__(self, cells: Dict[str, Any], manager: Any, te_base: type, op_base: type):
        self._func, self._training = cells["func"], cells["graph_training_state"]
        self._graphed, self._orig, self._helpers = cells["graphed"], cells["orig_fwd"], cells["helpers"]
        self._te_modules = cells["te_modules"]
        self._manager, self._te_base, self._op_base = manager, te_base, op_base
        self._lists: Dict[bool, Tuple[Tuple[Any, Optional[str]], ...]] = {}
        self._early = _forward_graph(self._graphed)  # TE's closure cells, or None: no early replay

    def _visits(self, fp8_attention: bool) -> Tuple[Tuple[Any, Optional[str]], ...]:
        """``(module, mode)`` in the order TE's walk meets them, as its loop filters them: captured
        TE modules (mode None; attention only if ``fp8_attention``), then for each captured basic
        operation its ``"forward"`` and ``"backward"`` metadata."""
        dpa = getattr(importlib.import_module(_DPA_MODULE), "DotProductAttention")
        out = []
        for m in self._func.modules():
            if m not in self._te_modules:
                continue
            if isinstance(m, self._te_base):
                if isinstance(m, dpa) and not fp8_attention:
                    continue
                out.append((m, None))
            elif isinstance(m, self._op_base):
                out += [(m, "forward"), (m, "backward")]
        return tuple(out)

    def __call__(self, *args, **kwargs):
        self._helpers.ensure_not_reset()
        if self._func.training != self._training:
            return self._orig(*args, **kwargs)
        mgr = self._manager
        if mgr.is_fp8_enabled():
            recipe = mgr.get_fp8_recipe()
            fp8_attention = bool(recipe.fp8_mha or recipe.fp8_dpa)
            visits = self._lists.get(fp8_attention)
            if visits is None:
                visits = self._lists[fp8_attention] = self._visits(fp8_attention)
            group, add = mgr.get_fp8_group(), mgr.add_fp8_tensors_to_global_buffer
            for m, mode in visits:
                if mode is None:
                    meta = m.fp8_meta
                elif m.num_quantizers(mode):  # as TE: asked on each call
                    meta = m._fp8_metas[mode]
                else:
                    continue
                meta["fp8_group"] = group
                meta["recipe"] = recipe
                add(meta)
        return self._graphed(*args, **kwargs)

    def launch(self, x: Any) -> Optional[Any]:
        """Replay the forward graph on ``x`` now, before this call's host work; then call
        :meth:`call_launched` with what this returns (the graph's static input, holding ``x``).

        None, nothing launched: ``x`` needs a gradient (the returned tensor carries none back to
        it), the graph takes several inputs, the module is not in the mode it was captured in (the
        call runs the module's own forward), TE's graphed function is not the one this knows, or the
        graph was captured with an input that needs a gradient (blocks called on their own, no stem:
        TE copies into that static leaf inside its autograd function and its backward hands the
        input's gradient on; given the leaf itself, autograd would accumulate it there).
        """
        if self._early is None or x.requires_grad or self._func.training != self._training:
            return None
        self._helpers.ensure_not_reset()
        graph, static = self._early["fwd_graph"].cell_contents, self._early["static_input_surface"].cell_contents[0]
        if not hasattr(graph, "__dict__") or static.requires_grad:  # replay cannot be shadowed; see above
            return None
        if static.data_ptr() != x.data_ptr():
            static.copy_(x)
        graph.replay()
        return static

    def call_launched(self, x: Any) -> Any:
        """This call after :meth:`launch`: the FP8 metadata walk and TE's graphed function (its
        autograd node, its static outputs) with the forward graph not replayed again."""
        graph = self._early["fwd_graph"].cell_contents
        graph.replay = _replayed  # what TE's Graphed.forward calls; the instance attribute goes after
        try:
            return self(x)
        finally:
            del graph.replay


def lean_graphed_forward(forward: Optional[Callable]) -> Optional[Callable]:
    """``forward`` (a module's forward from ``te.make_graphed_callables``) without its per-call
    module walk, or ``forward`` itself where it is not TE 2.20's (module docstring). None stays None."""
    code = getattr(forward, "__code__", None)
    if code is None or forward.__closure__ is None:
        return forward
    if frozenset(code.co_freevars) != _FREEVARS or frozenset(code.co_names) != _NAMES:
        return forward
    cells = _cells(forward)
    if len(cells) != len(_FREEVARS):  # an empty cell
        return forward
    g = forward.__globals__
    try:
        manager, te_base, op_base = g["FP8GlobalStateManager"], g["TransformerEngineBaseModule"], g["BasicOperation"]
    except KeyError:
        return forward
    return _LeanForward(cells, manager, te_base, op_base)
