"""Import paths of fp8vit 0.1's flat layout, kept working after the modules moved into layers.

``from fp8vit.block import TE_Block`` (or a whole-model pickle that names ``fp8vit.block``) still
works: the old name is an alias whose attributes are the new modules', with one
``DeprecationWarning`` naming where to import from now. The public API is ``from fp8vit import ...``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Tuple

__all__ = ["MOVED", "install"]

# old module -> the modules that now hold what it held (looked up in this order)
MOVED = {
    "fp8vit.block": ("fp8vit.blocks.vit",),
    "fp8vit.eva": ("fp8vit.blocks.eva",),
    "fp8vit.layers": ("fp8vit.blocks.base",),
    "fp8vit.config": ("fp8vit.blocks.config", "fp8vit.blocks.timm_layers"),
    "fp8vit.mlp": ("fp8vit.blocks.mlp",),
    "fp8vit.weights": ("fp8vit.blocks.weights",),
    "fp8vit.linear": ("fp8vit.blocks.linear",),
    "fp8vit.backend": ("fp8vit.blocks.backend",),
    "fp8vit.reference": ("fp8vit.blocks.reference",),
    "fp8vit.families": ("fp8vit.blocks.families",),
    "fp8vit.context": ("fp8vit.training.context",),
    "fp8vit.graphs": ("fp8vit.training.graphs",),
    "fp8vit.guards": ("fp8vit.training.guards",),
    "fp8vit.distributed": ("fp8vit.training.distributed", "fp8vit.training.checkpoint"),
    "fp8vit.diagnostics": ("fp8vit.training.diagnostics",),
    "fp8vit.detect": ("fp8vit.training.detect",),
    "fp8vit.numerics": ("fp8vit.training.numerics",),
    "fp8vit.recipes": ("fp8vit._te.recipes", "fp8vit.training.detect"),
    "fp8vit.kernels": ("fp8vit._te.kernels",),
}


class _Alias(types.ModuleType):
    """An old module name: each attribute is looked up in the modules that hold it now."""

    def __init__(self, name: str, targets: Tuple[str, ...]):
        super().__init__(name, f"Moved to {', '.join(targets)}.")
        self.__targets = targets

    def __getattr__(self, attr: str):
        for target in self.__targets:
            module = importlib.import_module(target)
            if hasattr(module, attr):
                return getattr(module, attr)
        raise AttributeError(f"{self.__name__} moved to {' and '.join(self.__targets)}, which have no {attr!r}; "
                             "the public API is `from fp8vit import ...` (fp8vit.__all__)")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        return importlib.machinery.ModuleSpec(fullname, self) if fullname in MOVED else None

    def create_module(self, spec):
        targets = MOVED[spec.name]
        warnings.warn(f"{spec.name} has moved to {' and '.join(targets)}: import from there, or from fp8vit "
                      "(the public API)", DeprecationWarning, stacklevel=2)
        return _Alias(spec.name, targets)

    def exec_module(self, module) -> None:
        pass


def install() -> None:
    """Make the old names importable (after every other finder: a real module always wins)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
