"""Lever 63's evidence: which cuBLASLt algorithm each GEMM form of a graphed ViT keeps when timed on
normal stand-in values (the default) against on the operands TE's warm-up hands it (before lever 63),
what those operands held, and both kept algorithms timed again on stand-in values.

    python3 docs/perf/gemm_search_ranks.py [MODEL] [BATCH]   # default vit_large_patch16_224 128

Two blocks: the forms (m, n, k, types) are the same in every block. Prints one row per form.
"""

import copy
import sys

import torch

import fp8vit  # TE first (docs/perf/te_env.sh), before torch's first cuDNN call
from fp8vit._te import gemm_residual as rg


def timed(plan, operands, algo, runs=20) -> float:
    """Microseconds a run of ``algo`` on ``operands``, after 3 untimed, CUDA events."""
    for _ in range(3):
        plan.run(*operands, algo=algo)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(runs):
        plan.run(*operands, algo=algo)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / runs * 1e3


def main(name: str = "vit_large_patch16_224", batch: int = 128) -> None:
    import timm
    torch.manual_seed(0)
    base = fp8vit.convert_to_te(timm.create_model(name, depth=2).cuda())
    stand_in, plans, operands, held = rg._stand_in, {}, {}, {}
    pick = rg._Plan.pick

    def keep_operands(plan, *ops):  # what each form was timed on: kept for the retiming below,
        operands[id(plan)] = ops    # and what TE's warm-up handed it (zeros, NaNs as FP8)
        dtype = torch.float8_e4m3fn if plan.x_type == rg._R_8F_E4M3 else torch.float8_e5m2
        v = ops[2].view(dtype).float()
        held[id(plan)] = (float((v == 0).float().mean()), float(v.isnan().float().mean()))
        pick(plan, *ops)

    rg._Plan.pick = keep_operands
    for mode, fn in (("stand-in", stand_in), ("as given", lambda x, x_type: x)):  # the latter: before lever 63
        rg._PLANS.clear()
        rg._stand_in = fn
        handle = fp8vit.make_graphed_blocks(copy.deepcopy(base).train(), batch)
        plans[mode] = {k: p for k, p in rg._PLANS.items() if p is not None}
        handle.release()
    rg._stand_in, rg._Plan.pick = stand_in, pick
    print(f"{name} b{batch}, {torch.cuda.get_device_name()}: kept rank by stand-in / as given; "
          "both kept algorithms timed on stand-in values (us)")
    print("form (m, n, k)      residual  x type  as given: zeros, NaN  rank  us stand-in's  us as-given's")
    for key, plan in plans["stand-in"].items():
        other = plans["as given"].get(key)
        if other is None:  # its operands' alignment differed between the two captures
            print(f"{str(key[1:4]):20s} not made in the second capture")
            continue
        w, sw, x, sx, *rest = operands[id(plan)]
        ops = (w, sw, stand_in(x, plan.x_type), sx, *rest)
        zeros, nans = held[id(plan)]
        a, b = timed(plan, ops, plan.algo), timed(plan, ops, plan.algos[other.rank])
        print(f"{str(key[1:4]):20s} {str(key[8]):9s} {'E4M3' if key[5] == rg._R_8F_E4M3 else 'E5M2':7s} "
              f"{zeros:8.3f} {nans:6.3f}        {plan.rank} / {other.rank}  {a:8.1f}  {b:8.1f}")


if __name__ == "__main__":
    main(*(sys.argv[1:2] or []), *(int(a) for a in sys.argv[2:3]))
