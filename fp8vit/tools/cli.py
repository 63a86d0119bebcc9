"""Argument types the tools' command lines share: numbers that must be at least, or more than, some bound.

``argparse``'s ``type=int`` takes ``--batch-size 0`` or ``--steps -3``, and the run then fails far
from the flag or, worse, reports nonsense (a batch of 0 images timed at 0 img/s). These types
refuse such a value at the command line, naming the flag, the value and what it counts.
"""

from __future__ import annotations

import argparse
from typing import Callable

__all__ = ["at_least", "more_than", "IMAGE_SIDE", "RECOMPUTE_EVERY"]


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


def more_than(bound: float, what: str) -> Callable[[str], float]:
    """An ``argparse`` ``type``: a number ``> bound`` (a price, a bandwidth).

    Args:
        bound: the value must exceed it.
        what: what the value is (``"a GPU's price per hour"``), for the error message.
    """
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number ({what})") from None
        if not value > bound:  # NaN too
            raise argparse.ArgumentTypeError(f"{text}: {what}, more than {bound:g}")
        return value
    return parse


# --img-size of every tool and examples/train_vit.py
IMAGE_SIDE = at_least(1, "image side in pixels")
# --mlp-recompute K of fp8vit-bench and examples/train_vit.py (fp8vit.set_mlp_recompute(every=K))
RECOMPUTE_EVERY = at_least(0, "K, the block interval (0: off, 1: every block)")
