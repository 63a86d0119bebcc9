"""FP8 numerics: the formats' limits, signal-to-noise ratio, and what per-tensor scaling flushes.

E4M3 (forward tensors) keeps 3 mantissa bits and reaches 448; E5M2 (gradients) keeps 2 and
reaches 57344. Per-tensor scaling maps a tensor's amax to the format's max, so elements far
below the amax underflow to zero.
"""

from __future__ import annotations

import math

import torch

from .._validate import check_type

__all__ = ["snr_db", "underflow_fraction", "E4M3_MAX", "E5M2_MAX", "E4M3_TINY", "E5M2_TINY"]

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
# Smallest subnormals: E4M3 2^-9, E5M2 2^-16. Values below half of them round to zero.
E4M3_TINY, E5M2_TINY = 2.0 ** -10, 2.0 ** -17


def snr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-noise ratio of ``test`` against ``ref``: ``10 log10(sum ref^2 / sum (ref - test)^2)``.

    Args:
        ref: the reference tensor.
        test: the tensor compared with it, of the same shape (no broadcasting: a mismatch is a
            mistake, not a comparison).

    Returns:
        dB; ``inf`` when identical, ``nan`` when either holds non-finite values, ``-inf`` when
        ``ref`` is all zeros but ``test`` is not.

    Raises:
        TypeError: ``ref`` or ``test`` is not a tensor.
        ValueError: their shapes differ.
    """
    check_type("snr_db", "ref", ref, torch.Tensor, "a torch.Tensor")
    check_type("snr_db", "test", test, torch.Tensor, "a torch.Tensor")
    if ref.shape != test.shape:
        raise ValueError(f"snr_db: ref is {list(ref.shape)} and test {list(test.shape)}; pass tensors of one shape")
    ref, test = ref.detach().double(), test.detach().double()
    if not (torch.isfinite(ref).all() and torch.isfinite(test).all()):
        return math.nan
    noise = float((ref - test).pow(2).sum())
    signal = float(ref.pow(2).sum())
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10 * math.log10(signal / noise)


def underflow_fraction(x: torch.Tensor, fmt_max: float, tiny: float) -> float:
    """Fraction of the nonzero elements of ``x`` that per-tensor FP8 scaling flushes to zero.

    Per-tensor scaling maps ``amax(x)`` to ``fmt_max``; an element whose scaled magnitude is below
    ``tiny`` (half the format's smallest subnormal) rounds to zero.
    """
    a = x.detach().abs().float()
    amax = float(a.max()) if a.numel() else 0.0
    nonzero = a > 0
    n = int(nonzero.sum())
    if n == 0 or not math.isfinite(amax):
        return 0.0
    return float(((a * (fmt_max / amax) < tiny) & nonzero).sum()) / n
