"""``convert_to_te(fallback="compile")``: the blocks fp8vit cannot fuse, compiled in place;
``convert_to_te(compile=True)``: the whole model around the fused blocks, the same way.

:func:`compile_block` does what ``nn.Module.compile()`` does (``module._compiled_call_impl =
torch.compile(module._call_impl)``: the same module object, parameters and state dict keys; the
module's ``__call__`` runs the compiled function) behind a guard: ``torch.compile`` compiles at
the first call, so a block that cannot compile fails there. The guard catches dynamo's and
inductor's exceptions (``torch._dynamo.exc.TorchDynamoException``, which ``InductorError``,
``BackendCompilerFailed``, ``Unsupported`` and ``TorchRuntimeError`` derive from) and runs the same
call eagerly: if the eager call raises too, the error is the model's own (a shape error shows
as ``TorchRuntimeError`` while tracing) and the eager error is raised, the block staying
compiled; if it runs, the block warns once, naming itself and the compiler's error, and runs
eagerly from then on. Failures of a backward compiled later than its forward are not caught.

Sibling blocks compile as one unit (:func:`compile_units`): where every child of an
``nn.Sequential`` is a block to compile (Swin's ``layers.N.blocks``, a ViT's ``blocks``), the
Sequential is compiled instead of each block. dynamo guards on each block's Python constants (a
drop-path rate per block, Swin's shifted/unshifted mask, a stage's width), so blocks compiled one by
one are one compilation each: Swin-B's 24 blocks took 65-90 s each on the H200, against 114 s for
all of ``torch.compile(model)``. A Sequential traces its blocks inline, in one compilation per
stage.

Pickling and ``copy.deepcopy`` drop the compilation (``nn.Module.__getstate__`` drops
``_compiled_call_impl``), as they do for ``nn.Module.compile()``.
"""

from __future__ import annotations

import warnings
from typing import List, Sequence, Tuple

import torch
from torch import nn

__all__ = ["compile_block", "compile_units", "is_compiled_at", "is_compiled_block", "uncompile_block",
           "allow_recompiles"]

# Marks the guard that compile_block installs, with the block's path (uncompile_block undoes
# only these, not a user's own nn.Module.compile()).
_MARK = "_fp8vit_compiled_block"
# On a unit's guard (compile_units): the names of the blocks it compiles, children of the module
_UNIT = "_fp8vit_compiled_unit"
# dynamo's default recompile limit per code object: kept free for other guards of the same blocks
_DEFAULT_RECOMPILES = 8


def _compiler_errors() -> tuple:
    try:
        from torch._dynamo.exc import TorchDynamoException
    except ImportError:  # pragma: no cover - every torch fp8vit supports has it
        return ()
    return (TorchDynamoException,)


def compile_block(module: nn.Module, fqn: str, origin: str = "convert_to_te(fallback='compile')",
                  unit: Tuple[str, ...] = ()) -> nn.Module:
    """Compile ``module`` in place (``torch.compile``'s defaults), with the guard of the module
    docstring; ``fqn`` names it in the warning (``""``: the model), ``origin`` the option that asked
    for it, ``unit`` the names of the children it compiles as one unit (:func:`compile_units`).
    Returns ``module``."""
    compiled = torch.compile(module._call_impl)
    errors = _compiler_errors()

    def call(*args, **kwargs):
        try:
            return compiled(*args, **kwargs)
        except errors as err:
            out = module._call_impl(*args, **kwargs)  # raises the model's own error, if it is one
            first = str(err).strip().splitlines()
            what = f"{type(module).__name__} of blocks {', '.join(unit)}" if unit else type(module).__name__
            warnings.warn(f"fp8vit: {fqn or '<model>'} ({what}) could not be compiled "
                          f"({origin}): {type(err).__name__}: "
                          f"{first[0] if first else ''}; it runs eagerly from now on", UserWarning, stacklevel=3)
            module._compiled_call_impl = None
            return out

    setattr(call, _MARK, fqn)
    setattr(call, _UNIT, tuple(unit))
    module._compiled_call_impl = call
    return module


def allow_recompiles(blocks: int) -> None:
    """Let dynamo compile each of ``blocks`` compiled blocks: raise its recompile limit (process-wide,
    never lowered) to ``blocks`` plus its default.

    Every block compiled by :func:`compile_block` is one code object to dynamo
    (``nn.Module._call_impl``), so blocks whose guards differ (another width, a Swin shift, a
    drop-path rate per block) are recompilations of it; past ``recompile_limit`` (8) dynamo runs the
    rest eagerly with a log warning: 12 blocks with drop-path rates of their own compiled 8.
    """
    cfg = torch._dynamo.config
    name = next((n for n in ("recompile_limit", "cache_size_limit") if hasattr(cfg, n)), None)
    if name is not None:  # renamed in torch 2.6; both spell the per-code-object limit
        setattr(cfg, name, max(int(getattr(cfg, name)), blocks + _DEFAULT_RECOMPILES))


def is_compiled_block(module: nn.Module) -> bool:
    """Whether :func:`compile_block` compiled ``module`` (and it has not fallen back to eager)."""
    return getattr(getattr(module, "_compiled_call_impl", None), _MARK, None) is not None


def compile_units(root: nn.Module, fqns: Sequence[str]) -> List[Tuple[str, Tuple[str, ...]]]:
    """The compilations that compile the blocks at ``fqns`` (paths in ``root``): ``(path, ())`` for
    a block compiled alone, ``(path, names)`` for an ``nn.Sequential`` of two or more children that
    are all in ``fqns`` (names: its children), compiled as one unit (module docstring)."""
    wanted = set(fqns)
    units, done = [], set()
    for fqn in fqns:
        if fqn in done:
            continue
        parent = fqn.rpartition(".")[0]
        container = root.get_submodule(parent) if "." in fqn else None
        names = [name for name, _ in container.named_children()] if container is not None else []
        if (type(container) is nn.Sequential and len(names) >= 2
                and all(f"{parent}.{name}" in wanted for name in names)):
            units.append((parent, tuple(names)))
            done.update(f"{parent}.{name}" for name in names)
        else:
            units.append((fqn, ()))
            done.add(fqn)
    return units


def is_compiled_at(root: nn.Module, fqn: str) -> bool:
    """Whether the block at ``fqn`` in ``root`` is compiled: by :func:`compile_block` itself, or as
    a child of a unit (:func:`compile_units`) that still is."""
    if is_compiled_block(root.get_submodule(fqn)):
        return True
    parent, _, name = fqn.rpartition(".")
    if not name or "." not in fqn:
        return False
    call = getattr(root.get_submodule(parent), "_compiled_call_impl", None)
    return getattr(call, _MARK, None) is not None and name in getattr(call, _UNIT, ())


def uncompile_block(module: nn.Module) -> bool:
    """Undo :func:`compile_block` on ``module`` (not a user's own ``nn.Module.compile()``);
    whether there was anything to undo."""
    if not is_compiled_block(module):
        return False
    module._compiled_call_impl = None
    return True
