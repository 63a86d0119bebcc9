"""Importing Transformer Engine: whether it imports here, why not, and its submodules.

``import transformer_engine.pytorch`` fails in several ways that need different fixes (not
installed, too old, no CUDA driver, the cuDNN clash); each becomes a reason in a cached
:class:`~fp8vit.errors.Check`. The rest of the seam reaches TE only through :func:`load_te` and
:func:`te_module`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import os
import types
import warnings
from typing import List, Optional, Tuple

import torch
from packaging.version import Version

from ..errors import Check, TEUnavailableError

__all__ = ["MIN_TE_VERSION", "INSTALL_HINT", "te_status", "te_version", "installed", "load_te", "preload",
           "release_import_warnings", "clear_cache", "te_check", "te_module"]

# The oldest TE fp8vit runs on: the version it is measured with, and the first that refuses to
# unpickle a checkpoint's FP8 state unless NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1 is set.
MIN_TE_VERSION = "2.20"

# fp8vit is not on PyPI, so "pip install 'fp8vit[te]'" would fail: TE's own package name works
# everywhere, and the extra from a clone is the same requirement.
INSTALL_HINT = (f"install it with: pip install \"transformer-engine[pytorch]>={MIN_TE_VERSION}\"  "
                "(or, in a clone of fp8vit: pip install '.[te]')")

def _explain_import_error(err: BaseException) -> str:
    """Turn an exception raised by ``import transformer_engine.pytorch`` into a reason."""
    msg = f"{type(err).__name__}: {err}"
    if isinstance(err, ModuleNotFoundError) and (err.name or "").split(".")[0] == "transformer_engine":
        return f"Transformer Engine is not installed; {INSTALL_HINT}"
    low = msg.lower()
    if "undefined symbol" in low and "cudnn" in low:
        cudnn_dir = _torch_cudnn_dir()
        return (
            "Transformer Engine loaded a different cuDNN than torch and failed with "
            f"'{msg}'. This happens when torch ran a cuDNN kernel (a conv, e.g. a ViT patch "
            "embedding) before TE was first imported. Fix: `import fp8vit` (which imports TE) "
            "before running any model, or point CUDNN_PATH and LD_LIBRARY_PATH at torch's cuDNN"
            + (f" ({cudnn_dir})" if cudnn_dir else "")
            + "."
        )
    if "libcuda" in low or "cuda driver" in low or "no cuda gpus" in low or "nvidia driver" in low:
        return f"Transformer Engine needs a CUDA driver and GPU, and failed with '{msg}'"
    return f"importing transformer_engine.pytorch failed with '{msg}'; {INSTALL_HINT}"


def _torch_cudnn_dir() -> Optional[str]:
    """The folder holding the cuDNN that torch uses (pip wheels: nvidia/cudnn/lib), if any."""
    spec = importlib.util.find_spec("nvidia")
    for root in list(spec.submodule_search_locations or []) if spec else []:
        for sub in ("cudnn/lib", "cu13/lib"):
            path = os.path.join(root, sub)
            if os.path.isdir(path) and any(f.startswith("libcudnn") for f in os.listdir(path)):
                return path
    return None


@functools.lru_cache(maxsize=None)
def _import() -> Tuple[Optional[types.ModuleType], str]:
    ver = te_version()
    if ver is not None and Version(ver) < Version(MIN_TE_VERSION):
        return None, (f"Transformer Engine {ver} is older than {MIN_TE_VERSION}, the oldest fp8vit supports "
                      "(older TE runs the pickle stored in a checkpoint's FP8 state when loading it); "
                      f"upgrade: pip install -U 'transformer-engine[pytorch]>={MIN_TE_VERSION}'")
    try:
        te = importlib.import_module("transformer_engine.pytorch")
    except Exception as err:  # noqa: BLE001 - every failure becomes a reason
        return None, _explain_import_error(err)
    return te, ""


# Warnings TE raised while ``import fp8vit`` imported it (preload), not yet issued: TE's notes about
# other frameworks (a Jax installation without TE's Jax extension) would otherwise print before a
# tool's first line. They are issued, with TE's file and line, at the first te_status() or load_te().
_held_import_warnings: List[warnings.WarningMessage] = []


def release_import_warnings() -> None:
    """Issue the warnings held from TE's import at ``import fp8vit`` (once; nothing if none)."""
    held = list(_held_import_warnings)
    _held_import_warnings.clear()
    for w in held:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def te_status() -> Check:
    """Whether Transformer Engine imports here. Cached (see :func:`clear_cache`).

    Returns:
        ``Check(ok, reason)``: ``reason`` is empty when ``ok``, else says why and how to fix it.
    """
    release_import_warnings()
    te, reason = _import()
    return Check(te is not None, reason)


def te_version() -> Optional[str]:
    """The installed Transformer Engine's version (from its distribution metadata), or None."""
    for dist in ("transformer_engine", "transformer-engine", "transformer_engine_torch"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def installed() -> bool:
    """Whether a ``transformer_engine`` package is installed (importable or not)."""
    return importlib.util.find_spec("transformer_engine") is not None


def clear_cache() -> None:
    """Forget the cached import result and capability answers (a failed import is retried)."""
    _import.cache_clear()
    te_check.cache_clear()
    te_module.cache_clear()


def load_te() -> types.ModuleType:
    """Return ``transformer_engine.pytorch`` or raise :class:`TEUnavailableError` with the reason."""
    release_import_warnings()
    te, reason = _import()
    if te is None:
        raise TEUnavailableError(reason)
    return te


def preload() -> None:
    """Import TE now if it is installed and a GPU is visible.

    TE must be imported before torch runs its first cuDNN kernel (see ``_explain_import_error``),
    so ``import fp8vit`` does it eagerly. Set ``FP8VIT_LAZY_TE=1`` to skip it. The warnings TE
    raises while it is imported (under the filters in force) are held and issued at the first
    :func:`te_status` or :func:`load_te`, where a tool can collect them (:func:`release_import_warnings`).
    """
    if os.environ.get("FP8VIT_LAZY_TE") == "1":
        return
    if not installed() or not torch.cuda.is_available():
        return
    with warnings.catch_warnings(record=True) as caught:  # the filters in force still apply
        _import()
    _held_import_warnings.extend(caught)


@functools.lru_cache(maxsize=None)
def te_check(fn_name: str) -> Check:
    """Ask TE one of its capability questions (``is_fp8_available``, ...). Cached; needs TE.

    Returns:
        TE's answer and reason, or a Check saying this TE lacks the function.
    """
    fn = getattr(load_te(), fn_name, None)
    if fn is None:
        return Check(False, f"this Transformer Engine has no {fn_name}()")
    ok, reason = fn(return_reason=True)
    return Check(bool(ok), reason or "")


@functools.lru_cache(maxsize=None)
def te_module(name: str) -> types.ModuleType:
    """A submodule of Transformer Engine (``"transformer_engine.common.recipe"``, ...), after
    :func:`load_te` (which raises with the reason where TE does not import)."""
    load_te()
    return importlib.import_module(name)
