"""Largest batch per variant, each probe in a fresh process (docs/performance.md, lever 14).

    python3 docs/perf/max_batch.py --model huge --budget-s 480 \
        fp8vit-mlp-recompute-every2-cudnn-norm-blockgraphs:768:960 timm-bf16:448:544

Each argument is ``variant:lo:hi``: the bisection assumes ``lo`` fits and ``hi`` does not, probes the
midpoints (multiples of ``--granularity``) and prints the interval it proved: the largest batch seen
to fit and the smallest seen to fail (an end that was assumed, not run, is marked so). Every probe
is ``levers.py --steps 1 --warmup 1`` in a new process, because probes in one process are not
independent: after a graphed run, the same batch no longer fits in the same process although torch
reports its memory as released (docs/performance.md, lever 14). ``--budget-s`` stops starting probes
after that many seconds, so a long list ends with what it proved so far.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def probe(model: str, variant: str, batch: int) -> bool:
    """Whether one training step of ``variant`` at ``batch`` runs, in a new process."""
    with tempfile.TemporaryDirectory() as out:
        p = subprocess.run([sys.executable, os.path.join(HERE, "levers.py"), "--model", model, "--batch",
                            str(batch), "--steps", "1", "--warmup", "1", "--variants", variant, "--out", out],
                           capture_output=True, text=True)
    text = p.stdout + p.stderr
    if re.search(rf"^{model} b{batch} {re.escape(variant)} +[0-9.]+ ms", p.stdout, re.M):
        return True
    if "OutOfMemoryError" in text:
        return False
    raise RuntimeError(f"{variant} at batch {batch} neither ran nor ran out of memory (rc {p.returncode}):\n"
                       + text[-2000:])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("brackets", nargs="+", help="variant:lo:hi")
    ap.add_argument("--model", default="huge")
    ap.add_argument("--granularity", type=int, default=16)
    ap.add_argument("--budget-s", type=float, default=480)
    a = ap.parse_args()
    t0 = time.perf_counter()
    for spec in a.brackets:
        variant, lo, hi = spec.rsplit(":", 2)
        lo, hi = int(lo), int(hi)
        lo_seen = hi_seen = False
        while hi - lo > a.granularity and time.perf_counter() - t0 < a.budget_s:
            mid = (lo + hi) // 2 // a.granularity * a.granularity
            t = time.perf_counter()
            ok = probe(a.model, variant, mid)
            print(f"  {variant} b{mid}: {'fits' if ok else 'out of memory'} ({time.perf_counter() - t:.0f} s)",
                  flush=True)
            if ok:
                lo, lo_seen = mid, True
            else:
                hi, hi_seen = mid, True
        print(f"{a.model} {variant}: largest batch in [{lo}{'' if lo_seen else ' (assumed)'}, "
              f"{hi}{'' if hi_seen else ' (assumed)'}) , step {a.granularity}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
