"""Exceptions raised by fp8vit. Each message names the value at fault and the fix."""

__all__ = ["TEUnavailableError", "FP8UnavailableError", "ConversionError"]


class TEUnavailableError(ImportError):
    """Transformer Engine cannot be imported or used here; the message says why."""


class FP8UnavailableError(RuntimeError):
    """FP8 was required (``strict=True`` or an explicit recipe) but cannot run on this machine."""


class ConversionError(ValueError):
    """A timm module cannot be converted to or from Transformer Engine; names the module."""
