"""Argument types the tools' command lines share: counts that must be at least some number.

``argparse``'s ``type=int`` takes ``--batch-size 0`` or ``--steps -3``, and the run then fails far
from the flag or, worse, reports nonsense (a batch of 0 images timed at 0 img/s). These types
refuse such a value at the command line, naming the flag, the value and what it counts.
"""

from __future__ import annotations

import argparse
from typing import Callable

__all__ = ["at_least"]


def at_least(minimum: int, what: str) -> Callable[[str], int]:
    """An ``argparse`` ``type``: an integer ``>= minimum``.

    Args:
        minimum: the smallest value taken.
        what: what the value counts (``"images per step"``), for the error message.

    Returns:
        the converter; on a bad value argparse exits with ``argument --flag: VALUE: ...``.
    """
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number ({what})") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value}: {what}, {minimum} or more")
        return value
    return parse
