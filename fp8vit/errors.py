"""Why something cannot run: exceptions, and the ``Check`` result of a capability probe.

Every message names the value at fault and the fix. A ``Check`` carries the same kind of reason,
so a probe's answer can be shown as a warning or raised as an error without rewording it.
"""

from typing import NamedTuple

__all__ = ["Check", "TEUnavailableError", "FP8UnavailableError", "ConversionError"]


class Check(NamedTuple):
    """The answer of a capability probe.

    Attributes:
        ok: whether the thing probed works here.
        reason: empty when ``ok``; otherwise why not and what would fix it.
    """

    ok: bool
    reason: str = ""


class TEUnavailableError(ImportError):
    """Transformer Engine cannot be imported or used here; the message says why."""


class FP8UnavailableError(RuntimeError):
    """FP8 was required (``strict=True`` or an explicit recipe) but cannot run on this machine."""


class ConversionError(ValueError):
    """A timm module cannot be converted to or from Transformer Engine; names the module."""
