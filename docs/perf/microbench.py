"""What the microbenchmarks in docs/perf share: time one forward + backward call, or say why a
kernel path refused the inputs; the error against a reference."""

from typing import Callable, Optional

import torch

from fp8vit.tools.timing import median_ms


def timed_or_refused(step: Callable[[], None], label: str) -> Optional[float]:
    """``step``'s median ms (30 calls after 10 warm-up, the host waiting for each), or None after
    printing ``label`` and the error, where the path refuses these inputs."""
    try:
        step()
        return median_ms(step, reps=30, warmup=10)
    except Exception as err:  # a backend or library that refuses these inputs: say so, go on
        print(f"{label} {'n/a':>10s} {'':>11s}   {type(err).__name__}: {str(err)[:150]}")
        return None


def max_rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest absolute difference relative to the reference's largest value."""
    return float((got.float() - ref).abs().max() / ref.abs().max())
