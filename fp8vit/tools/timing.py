"""GPU-timed intervals: what every printed time of the tools and examples is measured with.

A CUDA kernel launch returns before the kernel has run, so a host clock read right after a training
step says how fast the host queued the step, not how long the GPU took: ``examples/train_vit.py``
printed 19.6 ms/step for a CUDA-graphed ViT-B step that took the GPU 28.3 ms (issue 24). A
:class:`Stopwatch` records CUDA events on the current stream and reads them only once the GPU has
reached the last one. On CPU, where the work is synchronous, it reads the host clock.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional, Union

import torch

__all__ = ["Stopwatch", "median_ms", "format_duration"]


class Stopwatch:
    """Time of the work issued on ``device`` between :meth:`start` and a read, as the device ran it.

    Between events, the time includes whatever the GPU waited for (host work it had nothing queued
    for, an input copy), as a training loop's wall time does, but never work still in its queue.

    Args:
        device: where the timed work runs (``"cuda"``, ``"cuda:1"``, ``"cpu"`` or a
            :class:`torch.device`). CUDA events go on that device's current stream.
    """

    def __init__(self, device: Union[str, torch.device]):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._start: Optional[Union[torch.cuda.Event, float]] = None

    def _mark(self) -> Union[torch.cuda.Event, float]:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def start(self) -> "Stopwatch":
        """Start (or restart) the interval at the current point of the device's stream."""
        self._start = self._mark()
        return self

    def elapsed_ms(self) -> float:
        """Milliseconds from :meth:`start` to now on the device; waits until the device gets there.

        Raises:
            RuntimeError: :meth:`start` was not called.
        """
        ms, _ = self._read()
        return ms

    def lap_ms(self) -> float:
        """:meth:`elapsed_ms`, and the next interval starts where this one ended (no gap between).

        Raises:
            RuntimeError: :meth:`start` was not called.
        """
        ms, self._start = self._read()
        return ms

    def _read(self):
        if self._start is None:
            raise RuntimeError("Stopwatch read before start(): call start() where the interval begins")
        end = self._mark()
        if not self.cuda:
            return (end - self._start) * 1e3, end
        end.synchronize()  # the GPU has run everything issued before this read
        return self._start.elapsed_time(end), end


def median_ms(fn: Callable, *args, device: Union[str, torch.device] = "cuda", reps: int = 50,
              warmup: int = 10) -> float:
    """Median time of ``fn(*args)`` on ``device`` over ``reps`` calls after ``warmup`` untimed ones,
    each call timed alone with a :class:`Stopwatch` (the host waits for each): for microbenchmarks.

    Args:
        fn: the work to time; its result is dropped.
        device: where ``fn`` runs.
        reps, warmup: timed and untimed calls.
    """
    for _ in range(warmup):
        fn(*args)
    watch = Stopwatch(device)
    times = []
    for _ in range(reps):
        watch.start()
        fn(*args)
        times.append(watch.elapsed_ms())
    return statistics.median(times)


def format_duration(seconds: float) -> str:
    """``41 s``, ``1.5 min`` or ``2.1 h``: a progress estimate's precision."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
