"""Levers 63 and 64's evidence: which cuBLASLt algorithm each GEMM form of a graphed ViT keeps, by
how the search times its candidates, against the fastest when all are timed again at length.

    python3 docs/perf/gemm_search_ranks.py [MODEL] [BATCH]   # default vit_large_patch16_224 128

Searches (each in a fresh graph capture of a 2-block copy: the forms are the same in every block):
- ``default``: normal stand-in values (lever 63), candidates in turn, median of ROUNDS (lever 64);
- ``one round``: stand-in values, one block of runs per candidate in order (lever 63 alone);
- ``as given``: the operands TE's warm-up hands the GEMM, one block each (lever 62 as first built;
  the untimed runs come first here, not each before its block).
Then every candidate of each form runs again on stand-in values, 10 runs at a time in turn, 10
rounds (CUDA events, median): the fastest is the reference. Prints a row per form and, per search,
what its kept algorithms lose to the fastest in a full step (forms x the model's blocks).
"""

import copy
import sys

import torch

import fp8vit  # TE first (docs/perf/te_env.sh), before torch's first cuDNN call
from fp8vit._te import gemm_residual as rg


def retime(plan, operands, rounds=10, runs=10) -> dict:
    """Microseconds a run of each candidate cuBLASLt runs (median round), in turn."""
    live = []
    for i, algo in enumerate(plan.algos):
        try:
            for _ in range(3):
                plan.run(*operands, algo=algo)
            live.append(i)
        except RuntimeError:
            pass
    times = {i: [] for i in live}
    for r in range(rounds):
        for i in (live if r % 2 == 0 else reversed(live)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(runs):
                plan.run(*operands, algo=plan.algos[i])
            end.record()
            times[i].append((start, end))
    torch.cuda.synchronize()
    return {i: sorted(s.elapsed_time(e) for s, e in ev)[rounds // 2] / runs * 1e3 for i, ev in times.items()}


def main(name: str = "vit_large_patch16_224", batch: int = 128) -> None:
    import timm
    with torch.device("meta"):
        depth = len(timm.create_model(name).blocks)
    torch.manual_seed(0)
    base = fp8vit.convert_to_te(timm.create_model(name, depth=2).cuda())
    stand_in, rounds, pick = rg._stand_in, rg.ROUNDS, rg._Plan.pick
    kept, operands, held = {}, {}, {}

    def keep_operands(plan, *ops):  # what each form was given: kept for the retiming below, and
        operands[id(plan)] = ops  # what TE's warm-up held (zeros, NaNs as FP8)
        dtype = torch.float8_e4m3fn if plan.x_type == rg._R_8F_E4M3 else torch.float8_e5m2
        v = ops[2].view(dtype).float()
        held[id(plan)] = (float((v == 0).float().mean()), float(v.isnan().float().mean()))
        pick(plan, *ops)

    rg._Plan.pick = keep_operands
    searches = {"default": (stand_in, rounds), "one round": (stand_in, 1), "as given": (lambda x, x_type: x, 1)}
    plans = {}
    for mode, (fn, r) in searches.items():
        rg._PLANS.clear()
        rg._stand_in, rg.ROUNDS = fn, r
        handle = fp8vit.make_graphed_blocks(copy.deepcopy(base).train(), batch)
        plans[mode] = {k: p for k, p in rg._PLANS.items() if p is not None}
        handle.release()
    rg._stand_in, rg.ROUNDS, rg._Plan.pick = stand_in, rounds, pick
    print(f"{name} b{batch} ({depth} blocks), {torch.cuda.get_device_name()}, cuBLASLt "
          f"{rg.load_cublaslt().cublasLtGetVersion()}: the algorithm each search kept (rank, us a run) "
          "against the fastest, all timed again on stand-in values")
    print(f"{'form (m, n, k)':20s} {'residual':8s} {'x':4s} {'warm-up x: zeros, NaN':22s} "
          + "".join(f"{m:>16s}" for m in searches) + "  fastest")
    lost = dict.fromkeys(searches, 0.0)
    for key, plan in plans["default"].items():
        w, sw, x, sx, *rest = operands[id(plan)]
        us = retime(plan, (w, sw, stand_in(x, plan.x_type), sx, *rest))
        best = min(us, key=us.get)
        cells = []
        for mode in searches:
            other = plans[mode].get(key)  # None: its operands' alignment differed in that capture
            t = us.get(other.rank, float("inf")) if other is not None else float("nan")
            lost[mode] += (t - us[best]) * depth
            cells.append(f"{'-' if other is None else other.rank:>3} {t:7.1f} us  ")
        zeros, nans = held[id(plan)]
        print(f"{str(key[1:4]):20s} {str(key[8]):8s} {'E4M3' if key[5] == rg._R_8F_E4M3 else 'E5M2':4s} "
              f"{zeros:10.3f} {nans:6.3f}     " + "".join(cells) + f"{best:3d} {us[best]:7.1f} us")
    print("a step loses to the fastest: " + ", ".join(f"{m} {v / 1e3:.3f} ms" for m, v in lost.items()))


if __name__ == "__main__":
    main(*(sys.argv[1:2] or []), *(int(a) for a in sys.argv[2:3]))
