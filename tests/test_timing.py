"""fp8vit.tools.timing on CPU: the Stopwatch's intervals and the progress durations' format."""

import time

import pytest

from fp8vit.tools.timing import Stopwatch, format_duration, median_ms


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


def test_median_ms_times_each_call_after_the_warmup():
    # calls sleep 20 ms, but the first three (the warm-up) 200 ms: they must not be timed
    calls = []

    def work(n):
        time.sleep(0.2 if len(calls) < 3 else 0.02 * n)
        calls.append(n)

    ms = median_ms(work, 1, device="cpu", reps=5, warmup=3)
    assert len(calls) == 8 and 20 <= ms < 100

@pytest.mark.parametrize("seconds, text", [(0.4, "0 s"), (41, "41 s"), (89, "89 s"), (90, "1.5 min"),
                                           (3000, "50.0 min"), (5400, "1.5 h")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text
