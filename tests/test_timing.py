"""fp8vit.tools.timing on CPU: the Stopwatch's intervals and the progress durations' format."""

import time

import pytest

from fp8vit.tools.timing import Stopwatch, format_duration


def test_stopwatch_laps_leave_no_gap_and_reads_need_a_start():
    with pytest.raises(RuntimeError, match="before start\\(\\)"):
        Stopwatch("cpu").elapsed_ms()
    w = Stopwatch("cpu").start()
    t0 = time.perf_counter()
    time.sleep(0.05)
    first = w.lap_ms()
    second = w.elapsed_ms()  # from the end of the first lap, not from start()
    total = (time.perf_counter() - t0) * 1e3
    assert first >= 50 and first + second <= total + 1
    assert second < first  # the lap restarted the interval (else second >= first)
    assert w.elapsed_ms() >= second  # elapsed_ms does not restart it

@pytest.mark.parametrize("seconds, text", [(0.4, "0 s"), (41, "41 s"), (89, "89 s"), (90, "1.5 min"),
                                           (3000, "50.0 min"), (5400, "1.5 h")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text
