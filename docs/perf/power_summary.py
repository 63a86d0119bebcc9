"""Power draw and SM clock per fp8vit-bench variant, from `POWER=1 bash docs/perf/h200.sh bench:...`
(docs/perf/h200.sh): nvidia-smi's samples (every 200 ms) in results/levers/power_NAME_GPU.log and
the bench's output with a wall-clock mark per line in results/levers/power_NAME_GPU.marks.log.

    python3 docs/perf/power_summary.py docs/results/levers/power_huge_b128_default4_h100.log

Each variant's window is the `[i/n] variant: X ms (T s; ...)` line's time less T (its build, warm-up
and steps; the bench rounds T, so the window never reaches back past the line before); only the
samples above 200 W count (the GPU busy), so a window's idle set-up drops out. `--interleave` runs
print no such lines (their variants alternate step by step): there is nothing to split.
A variant drawing the card's limit (700 W on an H100 SXM) with its SM clock under the card's maximum
is power-bound: there a step's time follows its energy, and a kernel that saves bytes saves less time
than its bandwidth promises.
"""
import argparse
import re
import statistics
from datetime import datetime, timedelta

# "18:56:34.45 [1/4] timm-bf16: 277.9 ms (27 s; about 4.2 min left)", "... [3/6] batch 8 timm-bf16: ...";
# T as "27 s" or "2.4 min"
DONE = re.compile(r"^(\d\d:\d\d:\d\d\.\d+) \[\d+/\d+\] ((?:batch \d+ )?\S+): ([\d.]+) ms \(([\d.]+) (s|min)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("power_log", help="results/levers/power_NAME_GPU.log (its .marks.log beside it)")
    parser.add_argument("--busy-w", type=float, default=200.0, help="samples above this count (W)")
    args = parser.parse_args()
    marks = args.power_log.removesuffix(".log") + ".marks.log"
    samples = []  # (time of day, W, MHz)
    with open(args.power_log) as f:
        next(f)  # header: timestamp, power.draw [W], clocks.current.sm [MHz], temperature.gpu
        for line in f:
            stamp, watts, mhz = [p.strip() for p in line.split(",")[:3]]
            when = datetime.strptime(stamp.split()[1][:12], "%H:%M:%S.%f")
            samples.append((when, float(watts.split()[0]), int(mhz.split()[0])))
    with open(marks) as f:
        done = [m for m in map(DONE.match, f) if m]
    if not done:
        raise SystemExit(f"power_summary: no '[i/n] variant: X ms (T s; ...)' line in {marks} "
                         "(an --interleave run prints none: its variants alternate step by step)")
    print(f"{'variant':34s} {'step ms':>8s} {'W median':>9s} {'SM MHz median':>14s} {'min':>5s} {'J/step':>7s} samples")
    previous = datetime.min
    for m in done:
        end = datetime.strptime(m.group(1), "%H:%M:%S.%f")
        took = float(m.group(4)) * (60 if m.group(5) == "min" else 1)
        start = max(end - timedelta(seconds=took), previous)
        previous = end
        busy = [s for s in samples if start <= s[0] <= end and s[1] > args.busy_w]
        if not busy:
            print(f"{m.group(2):34s} no sample above {args.busy_w} W")
            continue
        watts = statistics.median(s[1] for s in busy)
        step = float(m.group(3))
        print(f"{m.group(2):34s} {step:8.1f} {watts:9.0f} {statistics.median(s[2] for s in busy):14.0f} "
              f"{min(s[2] for s in busy):5d} {watts * step / 1e3:7.0f} {len(busy)}")


if __name__ == "__main__":
    main()
