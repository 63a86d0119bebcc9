"""One warning per distinct message per process: fp8vit's fallbacks explain themselves once."""

from __future__ import annotations

import warnings

__all__ = ["warn_once"]

_seen: set = set()


def warn_once(message: str, category: type = UserWarning, stacklevel: int = 2) -> None:
    """``warnings.warn(message)`` unless this exact message was already issued by fp8vit."""
    if message not in _seen:
        _seen.add(message)
        warnings.warn(message, category, stacklevel=stacklevel + 1)
