"""Argument checks of fp8vit's public entries: one message style for all of them.

Each check runs at the call, before any work, and names the entry, the argument, the value and
what is accepted::

    convert_to_te(backend='bogus'): use one of ['te', 'reference'] or None (automatic)
    set_mlp_recompute(every=0): must be an integer >= 1
    NonFiniteGuard(optimizer='sgd'): expected a torch.optim.Optimizer, got str

``TypeError`` for a value of the wrong type, ``ValueError`` for a value of the right type outside
the accepted choices or range. Every check returns the value, so ``x = check_...(...)`` reads
naturally.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Any, Iterable, List, Optional, Sequence, Tuple, Type, Union

import torch

__all__ = ["show", "check_type", "check_bool", "check_choice", "check_int", "check_number", "check_callable",
           "check_items", "check_dtype", "check_device", "check_path", "check_process_group", "check_model",
           "check_module_filter"]

_MAX_REPR = 60


def show(value: Any) -> str:
    """``repr(value)`` for a message: whole when short, else the type (a model's repr is pages long)."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not hide the error being reported
        text = ""
    if text and len(text) <= _MAX_REPR and "\n" not in text:
        return text
    return f"<{type(value).__module__}.{type(value).__qualname__} object>"


def _head(fn: str, name: str, value: Any) -> str:
    return f"{fn}({name}={show(value)})"


def check_type(fn: str, name: str, value: Any, types: Union[type, Tuple[type, ...]], expected: str, *,
               none_ok: bool = False) -> Any:
    """``value`` if it is an instance of ``types`` (or None with ``none_ok``).

    Args:
        fn: the public entry, as the user calls it (``"convert_to_te"``, ``"TE_Block"``).
        name: the argument.
        value: what was passed.
        types: the accepted types.
        expected: them in words (``"a torch.nn.Module"``).
        none_ok: None is accepted too.

    Raises:
        TypeError: naming the value, its type and ``expected``.
    """
    if (value is None and none_ok) or isinstance(value, types):
        return value
    raise TypeError(f"{_head(fn, name, value)}: expected {expected}{' or None' if none_ok else ''}, "
                    f"got {type(value).__name__}")


def check_bool(fn: str, name: str, value: Any) -> bool:
    """``value`` if it is True or False (not 0, 1 or None: a flag is a bool).

    Raises:
        TypeError: anything else.
    """
    if isinstance(value, bool):
        return value
    raise TypeError(f"{_head(fn, name, value)}: pass True or False")


def check_choice(fn: str, name: str, value: Any, choices: Sequence[Any], *, none_ok: bool = False,
                 also: str = "") -> Any:
    """``value`` if it is one of ``choices`` (or None with ``none_ok``).

    Args:
        choices: the accepted values (names, dtypes, ...).
        none_ok: None is accepted too (the message says so: ``or None``, then ``also``).
        also: text appended verbatim to the list of choices (``" (automatic)"``,
            ``", or a TE recipe object"``).

    Raises:
        TypeError: ``value`` is of none of the choices' types.
        ValueError: it is of their type but not one of them.
    """
    if value is None and none_ok:
        return value
    ok_type = any(isinstance(value, type(c)) for c in choices)
    if ok_type and any(value == c for c in choices):
        return value
    accepted = f"use one of {list(choices)}" + (" or None" if none_ok else "") + also
    raise (ValueError if ok_type else TypeError)(f"{_head(fn, name, value)}: {accepted}")


def _interval(lo, hi, lo_open: bool, hi_open: bool) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo}"
    return f"{'<' if hi_open else '<='} {hi}"


def check_int(fn: str, name: str, value: Any, *, min: Optional[int] = None, none_ok: bool = False,  # noqa: A002
              hint: str = "") -> Optional[int]:
    """``value`` if it is an integer (not a bool) ``>= min`` (or None with ``none_ok``).

    Args:
        hint: what the number means, appended to the message (``"(1: every block, 2: ...)"``).

    Raises:
        TypeError: not an integer (a float or a bool included).
        ValueError: below ``min``.
    """
    if value is None and none_ok:
        return value
    what = "an integer" + (f" {_interval(min, None, False, False)}" if min is not None else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{_head(fn, name, value)}: expected {what}{' or None' if none_ok else ''}, "
                        f"got {type(value).__name__}{f' {hint}' if hint else ''}")
    if min is not None and value < min:
        raise ValueError(f"{_head(fn, name, value)}: must be {what}{f' {hint}' if hint else ''}")
    return value


def check_number(fn: str, name: str, value: Any, *, min: Optional[float] = None,  # noqa: A002
                 max: Optional[float] = None, min_open: bool = False, max_open: bool = False,  # noqa: A002
                 none_ok: bool = False) -> Optional[float]:
    """``value`` if it is a real number (not a bool, not NaN) within the bounds (or None with ``none_ok``).

    Args:
        min, max: the bounds, None for none.
        min_open, max_open: the bound itself is excluded.

    Raises:
        TypeError: not a real number (a bool included).
        ValueError: NaN, or outside the bounds.
    """
    if value is None and none_ok:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{_head(fn, name, value)}: expected a number{' or None' if none_ok else ''}, "
                        f"got {type(value).__name__}")
    if math.isnan(value):
        raise ValueError(f"{_head(fn, name, value)}: must be a number, not NaN")
    if min is None and max is None:
        return value
    low_bad = min is not None and (value <= min if min_open else value < min)
    high_bad = max is not None and (value >= max if max_open else value > max)
    if low_bad or high_bad:
        raise ValueError(f"{_head(fn, name, value)}: must be {_interval(min, max, min_open, max_open)}")
    return value


def check_callable(fn: str, name: str, value: Any, expected: str = "a callable", *, none_ok: bool = False) -> Any:
    """``value`` if it is callable (or None with ``none_ok``).

    Raises:
        TypeError: not callable.
    """
    if (value is None and none_ok) or callable(value):
        return value
    raise TypeError(f"{_head(fn, name, value)}: expected {expected}{' or None' if none_ok else ''}, "
                    f"got {type(value).__name__}")


def check_items(fn: str, name: str, value: Any, types: Union[type, Tuple[type, ...]], expected: str) -> List[Any]:
    """``list(value)`` if ``value`` is an iterable (not a str, not a tensor) whose items are all ``types``.

    Args:
        expected: the items in words (``"torch.nn.Module"``).

    Raises:
        TypeError: not an iterable, a str or a tensor, or an item of another type (named with
            its index).
    """
    if isinstance(value, (str, bytes, torch.Tensor)) or not isinstance(value, Iterable):
        raise TypeError(f"{_head(fn, name, value)}: expected a list of {expected}, got {type(value).__name__}")
    items = list(value)
    for i, item in enumerate(items):
        if not isinstance(item, types):
            raise TypeError(f"{fn}({name}[{i}]={show(item)}): expected {expected}, got {type(item).__name__}")
    return items


def check_dtype(fn: str, name: str, value: Any, *, none_ok: bool = False) -> Optional[torch.dtype]:
    """``value`` if it is a floating-point ``torch.dtype`` (or None with ``none_ok``).

    Raises:
        TypeError: not a ``torch.dtype``.
        ValueError: an integer or complex dtype.
    """
    check_type(fn, name, value, torch.dtype, "a torch.dtype (e.g. torch.float32, torch.bfloat16)", none_ok=none_ok)
    if value is not None and not value.is_floating_point:
        raise ValueError(f"{_head(fn, name, value)}: must be a floating-point dtype, e.g. torch.float32 "
                         "or torch.bfloat16")
    return value


def check_device(fn: str, name: str, value: Any, *, none_ok: bool = False) -> Any:
    """``value`` if ``torch.device(value)`` takes it (a ``torch.device``, ``"cuda:0"``, an index).

    Raises:
        TypeError: of a type ``torch.device`` does not take (a bool included).
        ValueError: a string that names no device.
    """
    if value is None and none_ok:
        return value
    if isinstance(value, bool) or not isinstance(value, (str, torch.device, int)):
        raise TypeError(f"{_head(fn, name, value)}: expected a torch.device, a device string such as 'cuda' or "
                        f"'cpu', or a CUDA index{' or None' if none_ok else ''}, got {type(value).__name__}")
    try:
        torch.device(value)
    except (RuntimeError, ValueError) as err:
        raise ValueError(f"{_head(fn, name, value)}: not a device ({err}); use e.g. 'cuda', 'cuda:0', 'cpu' "
                         "or 'meta'") from None
    return value


def check_path(fn: str, name: str, value: Any) -> Union[str, os.PathLike]:
    """``value`` if it is a file-system path (``str`` or ``os.PathLike``).

    Raises:
        TypeError: anything else.
    """
    return check_type(fn, name, value, (str, os.PathLike), "a folder path (str or os.PathLike)")


def check_process_group(fn: str, name: str, value: Any) -> Any:
    """``value`` if it is a ``torch.distributed`` process group or None.

    Raises:
        TypeError: anything else (e.g. a ``DeviceMesh``: pass ``mesh.get_group()``).
    """
    if value is None:
        return value
    group: Type = getattr(torch.distributed, "ProcessGroup", ()) if torch.distributed.is_available() else ()
    return check_type(fn, name, value, group, "a torch.distributed.ProcessGroup")


def check_model(fn: str, model: Any) -> torch.nn.Module:
    """``model`` if it is a ``torch.nn.Module`` (a timm model or block).

    Raises:
        TypeError: anything else.
    """
    return check_type(fn, "model", model, torch.nn.Module, "a torch.nn.Module (a timm model or block)")


def check_module_filter(fn: str, module_filter_fn: Any) -> Any:
    """``module_filter_fn`` if it is None or a callable ``fn(module, fqn) -> bool``.

    Raises:
        TypeError: anything else.
    """
    return check_callable(fn, "module_filter_fn", module_filter_fn, "a callable fn(module, fqn) -> bool",
                          none_ok=True)
