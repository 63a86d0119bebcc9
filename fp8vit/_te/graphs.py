"""CUDA graphs of TE modules, and weight gradients written straight into fp32 buffers.

:func:`make_graphed_callables` is TE's capture (FP8 scaling read from device memory inside the
graphs, updated outside them), leaving TE's process-wide state as it found it when the capture
fails; :func:`wgrad_into_main_grad` makes TE's weight-gradient GEMMs write into ``weight.main_grad``
(the graphed blocks hand those buffers to autograd themselves); :func:`save_scaling` and
:func:`restore_scaling` keep delayed-scaling state across a capture that fails.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import sys
import types
from typing import Any, List

import torch
from torch import nn

from .fp8 import _delayed_states
from .loader import load_te, te_module

__all__ = ["make_graphed_callables", "wgrad_into_main_grad", "release_main_grad", "save_scaling", "restore_scaling"]


def make_graphed_callables(modules, sample_args, *, fp8: bool, recipe: Any, num_warmup_iters: int,
                           amax_reduction_group=None, sample_kwargs=None, pool=None,
                           post_warmup_hook=None) -> bool:
    """``te.make_graphed_callables``: forward and backward of each module captured as CUDA graphs.

    FP8 scaling factors are read from device memory inside the graphs and updated outside them
    (TE's amax reduction at the end of each autocast/backward), so delayed scaling keeps working.

    Args:
        modules: one module, or a tuple of modules called one after the other (captured in that
            order: all forwards, then the backwards in reverse, sharing one memory pool).
        sample_args: ``(tensor, ...)`` for one module, or one such tuple per module.
        sample_kwargs: None, or one dict of tensor keyword inputs per module.
        pool: a graph memory pool (``torch.cuda.graph_pool_handle()``) shared with other
            captures; None: a pool of its own.
        post_warmup_hook: called once between TE's warm-up passes and the capture.

    TE installs each graphed forward on its module (``module.forward``, with ``backward_dw`` and
    ``reset``). If the capture raises, TE's own clean-up does not run: the class ``__call__`` it
    wrapped in its autocast, its "capturing" flag (which stops every later amax reduction) and the
    garbage collector it paused are restored here before the error propagates.

    Returns:
        True where TE can return parameter gradients as views of the backward graph's static
        buffers instead of copies (``clone_param_grads_on_return=False``), which it is then told
        to do: the caller must copy a ``.grad`` that still points into them before the next replay
        (forward or backward), which may rewrite them. False: TE copies them (older TE).
    """
    te = load_te()
    kwargs = {}
    accepted = inspect.signature(te.make_graphed_callables).parameters
    grads_alias = "clone_param_grads_on_return" in accepted
    if grads_alias:
        kwargs["clone_param_grads_on_return"] = False
    if sample_kwargs is not None:
        kwargs["sample_kwargs"] = sample_kwargs
    if pool is not None and "pool" in accepted:
        kwargs["pool"] = pool
    if post_warmup_hook is not None and "post_warmup_hook" in accepted:
        kwargs["post_warmup_hook"] = post_warmup_hook
    if isinstance(modules, tuple) and len(modules) == 1 and sample_kwargs is None:
        modules, sample_args = modules[0], sample_args[0]
    mods = modules if isinstance(modules, tuple) else (modules,)
    classes = {type(m) for m in mods}
    calls = {cls: cls.__dict__.get("__call__") for cls in classes}
    gc_was_enabled = gc.isenabled()
    try:
        with _fresh_leaves(mods) as originals:
            te.make_graphed_callables(
                modules, sample_args, num_warmup_iters=num_warmup_iters, enabled=fp8,
                recipe=recipe if fp8 else None, amax_reduction_group=amax_reduction_group,
                cache_quantized_params=False, **kwargs)
            for m in mods:
                _rebind_params(m, originals)
    except BaseException:
        for cls, call in calls.items():  # TE wraps the class's __call__ for the capture's duration
            if call is None:
                if "__call__" in cls.__dict__:
                    delattr(cls, "__call__")
            else:
                cls.__call__ = call
        graph = te_module("transformer_engine.pytorch.graph")
        if hasattr(graph, "set_capture_end"):
            graph.set_capture_end()
        if gc_was_enabled:
            gc.enable()
        _unstick_generators()
        raise
    return grads_alias


@contextlib.contextmanager
def _fresh_leaves(modules):
    """While TE captures: each parameter of ``modules`` as a new leaf tensor (same storage, same
    attributes: ``main_grad``), so that autograd makes it a new gradient accumulator on the capture
    stream. Yields ``{id(new): original}``.

    Why: autograd delivers a leaf's gradient on the stream its accumulator was made on. A capture
    inside a training step (the shape cache) finds each parameter's accumulator alive from an
    earlier step (the loss of the previous step, or DDP, holds it) and made on the default stream,
    and the backward capture fails with "operation would make the legacy stream depend on a
    capturing blocking stream" (H200, torch 2.11; torch added set_override_stale_capture_stream
    later for this)."""
    slots = [(m, name, p) for root in modules for m in root.modules()
             for name, p in m._parameters.items() if p is not None]
    originals = {}
    try:
        for m, name, p in slots:
            q = nn.Parameter(p.detach(), requires_grad=p.requires_grad)
            q.__dict__.update(p.__dict__)
            m._parameters[name] = q
            originals[id(q)] = p
        yield originals
    finally:
        for m, name, p in slots:
            m._parameters[name] = p


def _rebind_params(module: nn.Module, originals: dict) -> None:
    """Point the graphed forward TE installed on ``module`` at the original parameters: TE's replay
    passes the parameters it saw at capture (its closure's ``module_params``) to autograd, which
    sends their gradients there."""
    found = []

    def visit(fn, depth):
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if name == "module_params" and isinstance(value, tuple):
                cell.cell_contents = tuple(originals.get(id(q), q) for q in value)
                found.append(name)
            elif isinstance(value, types.FunctionType) and depth < 3:
                visit(value, depth + 1)

    forward = vars(module).get("forward")
    if isinstance(forward, types.FunctionType):
        visit(forward, 0)
    if not found:
        te = sys.modules.get("transformer_engine")
        raise RuntimeError(f"fp8vit: the graphed forward Transformer Engine "
                           f"{getattr(te, '__version__', '?')} installed on {type(module).__name__} "
                           "has no 'module_params' fp8vit knows how to point at the model's parameters")


def _unstick_generators() -> None:
    """After a capture that raised: give the CUDA generators a fresh copy of their state.

    A capture marks each registered generator state as capturing and unmarks it when the capture
    ends well; when ``cudaStreamEndCapture`` fails (the capture was invalidated) torch raises before
    unmarking, and every later random op of the process (cuDNN attention's dropout seed included)
    fails with "Offset increment outside graph capture encountered unexpectedly". A clone keeps the
    seed and offset and is not marked.
    """
    if not torch.cuda.is_initialized():
        return
    gens = [torch.cuda.default_generators[torch.cuda.current_device()]]
    gens += list(te_module("transformer_engine.pytorch.distributed").get_all_rng_states().values())
    for gen in gens:
        if isinstance(gen, torch.Generator) and hasattr(gen, "graphsafe_set_state"):
            gen.graphsafe_set_state(gen.clone_state())


def save_scaling(modules) -> list:
    """Copies of the delayed-scaling state (scale, amax history) of every TE module under
    ``modules``, for :func:`restore_scaling`."""
    with torch.no_grad():
        return [(st, st.scale.clone(), st.amax_history.clone())
                for m in modules for _, _, st in _delayed_states(m)]


def restore_scaling(saved: list) -> None:
    """Copy :func:`save_scaling`'s copies back, in place (TE's amax buffers hold these tensors)."""
    with torch.no_grad():
        for st, scale, amax in saved:
            if st.scale.shape == scale.shape and st.amax_history.shape == amax.shape:
                st.scale.copy_(scale)
                st.amax_history.copy_(amax)


def _gemm_weights(module: nn.Module) -> List[nn.Parameter]:
    """The weights whose gradient a TE GEMM module's wgrad GEMM computes, where TE passes each one
    to its GEMM as is ([] for other modules).

    A ``Linear``/``LayerNormLinear`` with split parameters (``parameters_split``, e.g. the QKV of
    ``te.TransformerLayer``) concatenates them into a new tensor first, which has no ``main_grad``:
    left alone.
    """
    if not hasattr(module, "fuse_wgrad_accumulation"):
        return []
    names = getattr(module, "weight_names", None)
    if names is None:  # LayerNormMLP: fc1 and fc2, each passed to its GEMM as is
        names = [n for n in ("fc1_weight", "fc2_weight") if isinstance(getattr(module, n, None), nn.Parameter)]
    elif len(names) != 1:
        return []
    return [getattr(module, n) for n in names]


@contextlib.contextmanager
def wgrad_into_main_grad(roots, reuse: bool = False):
    """Within: TE's wgrad GEMMs under ``roots`` write each weight's gradient straight into
    ``weight.main_grad``, a buffer of the weight's dtype (fp32 for fp32 weights), overwriting it.

    TE's ``fuse_wgrad_accumulation`` with ``weight.overwrite_main_grad = True`` (read by TE in
    forward). By default TE's wgrad GEMM writes the gradient in the activation dtype (bf16), and
    autograd then casts it to the parameter's dtype: one more kernel per weight, 6 bytes moved per
    parameter. With this, TE returns *no* weight gradient to autograd: the caller hands
    ``main_grad`` to autograd itself. The buffers are allocated here, stay on the weights after
    exit (a CUDA graph captured within writes into them), and ``release_main_grad`` removes them.
    Modules with a frozen weight are left alone.

    Args:
        roots: modules whose submodules are switched (e.g. fp8vit's ``TE_Block`` instances).
        reuse: keep a weight's ``main_grad`` from an earlier call (same shape, dtype and device):
            graphs captured then write into it, so it must not move.

    Yields:
        the weights that now get their gradient in ``main_grad``.
    """
    fused, weights = [], []
    for mod in (m for root in roots for m in root.modules()):
        ws = _gemm_weights(mod)
        if not ws or not all(w.requires_grad for w in ws) or mod.fuse_wgrad_accumulation:
            continue
        for w in ws:
            old = vars(w).get("main_grad")
            if not (reuse and isinstance(old, torch.Tensor) and old.shape == w.shape and old.dtype == w.dtype
                    and old.device == w.device):
                w.main_grad = torch.empty_like(w, memory_format=torch.contiguous_format)
            w.overwrite_main_grad = True  # TE: the GEMM writes (beta = 0), it does not accumulate
        mod.fuse_wgrad_accumulation = True
        fused.append(mod)
        weights.extend(ws)
    try:
        yield weights
    finally:
        # TE reads the switch in each eager forward: off again, an eager call computes and returns
        # its weight gradients as usual.
        for mod in fused:
            mod.fuse_wgrad_accumulation = False


def release_main_grad(weights) -> None:
    """Drop the ``main_grad`` buffers :func:`wgrad_into_main_grad` put on ``weights``."""
    for w in weights:
        for attr in ("main_grad", "overwrite_main_grad"):
            if attr in vars(w):
                delattr(w, attr)
