"""Is there a cuDNN SDPA execution plan faster than the heuristic's first, for ViT attention shapes?

    . docs/perf/te_env.sh; python3 dev/sdpa_plans_bench.py 2>&1 | grep -v Warn
    (options: --shapes vit_b,vit_l,vit_h  --rounds 10  --runs 10  --modes A,FALLBACK)

TE's fused attention runs the plan cuDNN's heuristic ranks first. This builds the same bf16
training attention with the cuDNN frontend's Python API (nvidia_cudnn_frontend, ``cudnn``) at
ViT-B/L/H's shapes (batch 128, 197 tokens, no mask, no dropout, scale 1/sqrt(D)) and times every
plan the heuristic lists, forward (``sdpa``, which also writes the softmax stats) and backward
(``sdpa_backward``). Q, K and V are views of one packed ``[B, S, 3, H, D]`` buffer and dQ, dK, dV
are written into one, as fp8vit's fused QKV GEMM lays them out. The list is the frontend's ranked
one: cuDNN's engine configs, and, where the CuTe DSL is installed, the frontend's own Python
kernels too (named ``sdpa_*``).

What: per shape, for each plan that builds and runs, the median over ``--rounds`` rounds of the GPU
time per call of ``--runs`` calls back to back between two CUDA events (plan order reversed every
other round so that drift falls on all of them), its error against torch in fp32 (forward: relative
max error of O and of the stats; backward: relative L2 error, the worst of dQ, dK, dV), and WRONG
where an error is over 3x plan 0's (such a plan never counts as the fastest). Then the fastest
correct plan against plan 0, the time a training step would save over the model's blocks, and TE's
``DotProductAttention`` at the same shape (forward, and forward + backward) for scale.

Every time printed is GPU time: each timed batch is queued behind a ``torch.cuda._sleep`` kernel
long enough for the host to enqueue the whole batch, so the frontend's Python per-call cost (tens
of microseconds, about the size of one attention call here) cannot leave gaps inside the timed span.
"""

import argparse
import math
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BATCH = 128
TOKENS = 197  # 14 x 14 patches + the class token (224 px, patch 16)
DTYPE = torch.bfloat16
# name: (heads H, head dim D, blocks per model): the blocks turn us per call into ms per step
SHAPES = {"vit_b": (12, 64, 12), "vit_l": (16, 64, 24), "vit_h": (16, 80, 32)}
WARMUP_CALLS = 3
WRONG_FACTOR = 3.0  # a plan whose error is over this many times plan 0's is marked WRONG
# errors below these count as these in the WRONG test: two correct plans' fp32 stats can differ by
# rounding alone, a few 1e-7, and 3x a number that small is no sign of a wrong plan
ERROR_FLOORS = {"O": 1e-6, "stats": 1e-4, "dQKV": 1e-6}
MIN_FILL_US = 200.0  # the least queue-filling sleep before a timed batch

cudnn = None  # the cuDNN frontend module, imported in main() after Transformer Engine


# ----------------------------------------------------------------------------- GPU timing
class GpuTimer:
    """Times callables on the GPU alone, median over rounds (see the module docstring).

    Args:
        rounds: rounds; in each, every callable runs ``runs`` times between two CUDA events.
        runs: calls per timed batch.
    """

    def __init__(self, rounds: int, runs: int):
        self.rounds, self.runs = rounds, runs
        self.sleep = getattr(torch.cuda, "_sleep", None)  # private, but in torch for years
        self.cycles_per_us = self._calibrate() if self.sleep is not None else 0.0

    def _calibrate(self) -> float:
        """Clock cycles per microsecond of ``torch.cuda._sleep`` (it spins for a cycle count)."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.sleep(10_000)  # first launch loads the kernel: keep it out of the measurement
        cycles = 20_000_000
        start.record()
        self.sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / (start.elapsed_time(end) * 1e3)

    def host_us(self, fn) -> float:
        """Host time per call of ``fn`` (what the queue-filling sleep must cover), in microseconds."""
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(self.runs):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return (t1 - t0) / self.runs * 1e6

    def time(self, calls: dict, host_us: float) -> dict:
        """Median GPU microseconds per call of each of ``calls`` (key -> callable).

        Args:
            calls: the callables, in the order of the forward rounds.
            host_us: the largest host time per call among them (``host_us``).
        """
        fill_cycles = int(max(MIN_FILL_US, 2.0 * self.runs * host_us) * self.cycles_per_us)
        keys = list(calls)
        per_round = {k: [] for k in keys}
        for r in range(self.rounds):
            marks = []
            for k in (keys if r % 2 == 0 else keys[::-1]):
                if self.sleep is not None:
                    self.sleep(fill_cycles)  # before `start`: untimed, but holds the GPU while the host queues
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(self.runs):
                    calls[k]()
                end.record()
                marks.append((k, start, end))
            torch.cuda.synchronize()  # before reading any event
            for k, start, end in marks:
                per_round[k].append(start.elapsed_time(end) * 1e3 / self.runs)
        return {k: statistics.median(v) for k, v in per_round.items()}


# ----------------------------------------------------------------------------- cuDNN graphs
def _bhsd(t: torch.Tensor) -> torch.Tensor:
    """``[B, S, H, D]`` view -> ``(B, H, S, D)`` view of the same memory: cuDNN's SDPA dim order."""
    return t.permute(0, 2, 1, 3)


def _describe(graph, name: str, t: torch.Tensor, data_type):
    """A graph input with ``t``'s dims and strides (element units, the views' own)."""
    return graph.tensor(name=name, dim=list(t.shape), stride=list(t.stride()), data_type=data_type)


def _as_output(gt, t: torch.Tensor, data_type=None):
    """Mark the graph tensor ``gt`` an output laid out like ``t`` (the buffer it will be bound to)."""
    gt.set_output(True).set_dim(list(t.shape)).set_stride(list(t.stride()))
    if data_type is not None:
        gt.set_data_type(data_type)
    return gt


def _new_graph(handle):
    """bf16 in and out, fp32 intermediates and compute: what TE's fused attention builds."""
    return cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
                         compute_data_type=cudnn.data_type.FLOAT, handle=handle)


def forward_graph(handle, q, k, v, o, stats, scale):
    """The training forward: O and the softmax stats from q, k, v ``(B, H, S, D)``.

    Returns:
        (graph, {name: graph tensor}) for the variant pack.
    """
    g = _new_graph(handle)
    bf16 = cudnn.data_type.BFLOAT16
    gq, gk, gv = (_describe(g, n, t, bf16) for n, t in (("q", q), ("k", k), ("v", v)))
    # is_inference=False: training, so the graph also writes Stats [B, H, S, 1] fp32 for the backward
    go, gstats = g.sdpa(name="sdpa", q=gq, k=gk, v=gv, is_inference=False, attn_scale=scale)
    _as_output(go, o)
    _as_output(gstats, stats, cudnn.data_type.FLOAT)
    return g, {"q": gq, "k": gk, "v": gv, "o": go, "stats": gstats}


def backward_graph(handle, q, k, v, o, do, stats, dq, dk, dv, scale):
    """The backward: dQ, dK, dV from q, k, v, O, dO ``(B, H, S, D)`` and the forward's stats.

    Returns:
        (graph, {name: graph tensor}) for the variant pack.
    """
    g = _new_graph(handle)
    bf16 = cudnn.data_type.BFLOAT16
    gq, gk, gv, go, gdo = (_describe(g, n, t, bf16) for n, t in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do)))
    gstats = _describe(g, "stats", stats, cudnn.data_type.FLOAT)
    gdq, gdk, gdv = g.sdpa_backward(name="sdpa_backward", q=gq, k=gk, v=gv, o=go, dO=gdo, stats=gstats,
                                    attn_scale=scale)
    for gt, t in ((gdq, dq), (gdk, dk), (gdv, dv)):
        _as_output(gt, t)
    return g, {"q": gq, "k": gk, "v": gv, "o": go, "do": gdo, "stats": gstats, "dq": gdq, "dk": gdk, "dv": gdv}


def _reason(err: Exception) -> str:
    """One line of an exception (the frontend's messages run to many lines)."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:300]}"


def build_all_plans(label: str, graph, modes) -> list:
    """Plan ``graph`` with the heuristic ``modes`` and build every plan it lists.

    Returns:
        [(index, name, workspace bytes)] of the plans that built, in the heuristic's order.
    """
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans(modes)
    graph.check_support()  # raises when no plan supports the graph: then there is nothing to time
    try:
        graph.build_plans(cudnn.build_plan_policy.ALL)
    except Exception as err:  # noqa: BLE001 - a plan's non-decline failure stops the walk; the loop below goes on
        print(f"  {label}: build_plans(ALL) stopped: {_reason(err)}")
    count = graph.get_execution_plan_count()
    built = []
    for i in range(count):
        name = "?"
        try:
            name = graph.get_plan_name_at_index(i)
            # an already-built plan is reused here; one that did not build says why
            graph.build_plan_at_index(i)
            built.append((i, name, int(graph.get_workspace_size_plan_at_index(i))))
        except Exception as err:  # noqa: BLE001 - any failure: the plan is skipped, named
            print(f"  {label} plan {i:2d} {name}: not built: {_reason(err)}")
    print(f"  {label}: {count} plans listed, {len(built)} built")
    return built


# ----------------------------------------------------------------------------- checks
def rel_max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref|, in fp32 (NaN where x holds NaN)."""
    return ((x.float() - ref).abs().max() / ref.abs().max()).item()


def rel_l2_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref||, in fp32 (NaN where x holds NaN)."""
    return (torch.linalg.vector_norm(x.float() - ref) / torch.linalg.vector_norm(ref)).item()


def reference(q, k, v, do, scale):
    """torch's attention in fp32 (math backend) on the bf16 values of q, k, v ``(B, H, S, D)``.

    Returns:
        (O, stats, dQ, dK, dV) fp32: O and the gradients ``(B, H, S, D)``, the backward for output
        gradient ``do``; stats ``(B, H, S, 1)``, the natural-log logsumexp of each row of the scaled
        scores, which is what cuDNN's Stats hold (cudnn-frontend test/python/sdpa/fp16_ref.py).
    """
    qf, kf, vf = (t.detach().float().contiguous().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):  # the plain fp32 softmax(QK^T)V, no fused kernel's rounding
        of = F.scaled_dot_product_attention(qf, kf, vf, scale=scale)
        grads = torch.autograd.grad(of, (qf, kf, vf), do.float())
    with torch.no_grad():
        stats = torch.logsumexp(scale * qf @ kf.transpose(-1, -2), dim=-1, keepdim=True)  # scores [B, H, S, S]
    return (of.detach(), stats) + tuple(grads)


def run_plans(label: str, graph, built, pack, workspace, handle, check, timer, outputs):
    """Run, check and time every built plan of ``graph``.

    Args:
        built: ``build_all_plans``' list.
        pack: the variant pack {graph tensor: torch tensor}.
        check: () -> {what: error} of the outputs as they are now (names in ERROR_FLOORS).
        outputs: the buffers the graph writes, NaN-filled before each plan's check so that a plan
            that writes nothing cannot pass.

    Returns:
        [(index, name, us per call, {what: error}, wrong)] for the plans that ran.
    """
    ran, host = [], 0.0
    for i, name, _ws in built:
        def call(i=i):
            graph.execute_plan_at_index(pack, workspace, index=i, handle=handle)
        try:
            for t in outputs:
                t.fill_(float("nan"))
            for _ in range(WARMUP_CALLS):
                call()
            torch.cuda.synchronize()
            err = check()
            host = max(host, timer.host_us(call))
        except Exception as exc:  # noqa: BLE001 - a plan that builds but cannot run is skipped, named
            print(f"  {label} plan {i:2d} {name}: did not run: {_reason(exc)}")
            continue
        ran.append((i, name, call, err))
    if not ran:
        return []
    times = timer.time({i: call for i, _n, call, _e in ran}, host)
    # the limits from plan 0's errors, or from the first plan that ran when plan 0 did not
    limits = {what: WRONG_FACTOR * max(e, ERROR_FLOORS[what]) if math.isfinite(e) else math.inf
              for what, e in ran[0][3].items()}

    def wrong(errors: dict) -> bool:  # NaN compares False: a plan with NaN in its outputs is WRONG
        return not all(math.isfinite(e) and e <= limits[what] for what, e in errors.items())
    return [(i, name, times[i], err, wrong(err)) for i, name, _c, err in ran]


def print_plans(label: str, results, built) -> None:
    """One line a plan: index (``*`` for plan 0, the heuristic's first), us per call, errors, WRONG."""
    ws = {i: b for i, _n, b in built}
    for i, name, us, errors, wrong in results:
        mark = "*" if i == 0 else " "
        errs = "  ".join(f"{what} {e:8.2e}" for what, e in errors.items())
        print(f"  {label} plan {i:2d}{mark} {us:9.1f} us  err {errs}  ws {ws[i] / 2**20:7.1f} MiB"
              f"{'  WRONG' if wrong else '       '}  {name}")


def fastest_vs_first(results):
    """(fastest correct plan, plan 0) result rows; either may be None."""
    good = [r for r in results if not r[4]]
    best = min(good, key=lambda r: r[2]) if good else None
    first = next((r for r in results if r[0] == 0), None)
    return best, first


# ----------------------------------------------------------------------------- TE reference
def time_te(te, heads: int, head_dim: int, timer: GpuTimer):
    """TE's ``DotProductAttention`` on q, k, v views of a packed ``[B, S, 3, H, D]`` buffer.

    Returns:
        (forward us, forward + backward us, TE's backend name or "?") per call.
    """
    attn = te.DotProductAttention(num_attention_heads=heads, kv_channels=head_dim, attention_dropout=0.0,
                                  qkv_format="bshd", attn_mask_type="no_mask")
    qkv = torch.randn(BATCH, TOKENS, 3, heads, head_dim, device="cuda", dtype=DTYPE, requires_grad=True)
    q, k, v = qkv.unbind(2)  # [B, S, H, D] views: TE finds the packed bs3hd layout from their pointers
    grad_out = torch.randn(BATCH, TOKENS, heads * head_dim, device="cuda", dtype=DTYPE)  # TE's output [B, S, H*D]

    def fwd():
        attn(q, k, v)

    def fwd_bwd():
        # grads of the views themselves: TE's dq, dk, dv (one packed buffer), with no accumulation into
        # qkv.grad and none of autograd's unbind backward (zero fill + copies), which fp8vit avoids too
        torch.autograd.grad(attn(q, k, v), (q, k, v), grad_out)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TE warns that pointer-based packed-layout detection is deprecated
        for _ in range(WARMUP_CALLS):
            fwd_bwd()
        host = max(timer.host_us(fwd), timer.host_us(fwd_bwd))
        times = timer.time({"fwd": fwd, "fwd_bwd": fwd_bwd}, host)
    return times["fwd"], times["fwd_bwd"], _te_backend()


def _te_backend() -> str:
    """The attention backend TE chose for its last call (its module-level record; "?" if absent)."""
    try:
        from transformer_engine.pytorch.attention.dot_product_attention import _attention_backends as chosen
        for key, name in (("use_flash_attention", "flash"), ("use_fused_attention", "fused (cuDNN)"),
                          ("use_unfused_attention", "unfused")):
            if chosen.get(key):
                return name
    except Exception:  # noqa: BLE001 - another TE lays this out otherwise
        pass
    return "?"


# ----------------------------------------------------------------------------- one shape
def bench_shape(shape: str, handle, modes, timer: GpuTimer, te) -> None:
    """Build, check and time the forward and backward plans at ``shape``; print the results."""
    heads, head_dim, blocks = SHAPES[shape]
    B, S, H, D = BATCH, TOKENS, heads, head_dim
    scale = 1.0 / math.sqrt(D)
    print(f"\n{shape}: B={B} S={S} H={H} D={D} bf16, no mask, no dropout, scale 1/sqrt(D); {blocks} blocks")
    dev = {"device": "cuda", "dtype": DTYPE}

    # the fused QKV GEMM's output [B, S, 3, H, D]; q, k, v are (B, H, S, D) views of it with
    # strides (S*3*H*D, D, 3*H*D, 1) at offsets 0, H*D, 2*H*D
    qkv = torch.randn(B, S, 3, H, D, **dev)
    q, k, v = (_bhsd(t) for t in qkv.unbind(2))
    o_out = _bhsd(torch.empty(B, S, H, D, **dev))  # strides (S*H*D, D, H*D, 1); written by every forward plan
    stats_out = torch.empty(B, H, S, 1, device="cuda", dtype=torch.float32)
    o_saved = _bhsd(torch.empty(B, S, H, D, **dev))  # plan 0's forward: the backward's inputs, kept apart
    stats_saved = torch.empty_like(stats_out)
    do = _bhsd(torch.randn(B, S, H, D, **dev))
    dqkv = torch.empty(B, S, 3, H, D, **dev)  # dQ, dK, dV packed like q, k, v
    dq, dk, dv = (_bhsd(t) for t in dqkv.unbind(2))

    o_ref, stats_ref, dq_ref, dk_ref, dv_ref = reference(q, k, v, do, scale)

    results = {}
    try:
        fg, ft = forward_graph(handle, q, k, v, o_out, stats_out, scale)
        fbuilt = build_all_plans("fwd", fg, modes)
    except Exception as err:  # noqa: BLE001 - no forward, no backward inputs: skip the shape
        print(f"  fwd: the graph could not be planned: {_reason(err)}")
        return
    if not fbuilt:
        return
    fws = torch.empty(max(max(b for _i, _n, b in fbuilt), 1), device="cuda", dtype=torch.uint8)
    fpack = {ft["q"]: q, ft["k"]: k, ft["v"]: v, ft["o"]: o_out, ft["stats"]: stats_out}

    def fcheck():
        return {"O": rel_max_err(o_out, o_ref), "stats": rel_max_err(stats_out, stats_ref)}
    results["fwd"] = run_plans("fwd", fg, fbuilt, fpack, fws, handle, fcheck, timer, [o_out, stats_out])
    print_plans("fwd", results["fwd"], fbuilt)
    if not results["fwd"]:
        print("  fwd: no plan ran")
        return

    # the backward's O and stats: from plan 0 (or the first forward plan that ran), as in training
    first_fwd = results["fwd"][0][0]
    fg.execute_plan_at_index({ft["q"]: q, ft["k"]: k, ft["v"]: v, ft["o"]: o_saved, ft["stats"]: stats_saved},
                             fws, index=first_fwd, handle=handle)
    torch.cuda.synchronize()
    del fws

    try:
        bg, bt = backward_graph(handle, q, k, v, o_saved, do, stats_saved, dq, dk, dv, scale)
        bbuilt = build_all_plans("bwd", bg, modes)
    except Exception as err:  # noqa: BLE001
        print(f"  bwd: the graph could not be planned: {_reason(err)}")
        bbuilt = []
    if bbuilt:
        bws = torch.empty(max(max(b for _i, _n, b in bbuilt), 1), device="cuda", dtype=torch.uint8)
        bpack = {bt["q"]: q, bt["k"]: k, bt["v"]: v, bt["o"]: o_saved, bt["do"]: do, bt["stats"]: stats_saved,
                 bt["dq"]: dq, bt["dk"]: dk, bt["dv"]: dv}

        def bcheck():
            return {"dQKV": max(rel_l2_err(dq, dq_ref), rel_l2_err(dk, dk_ref), rel_l2_err(dv, dv_ref))}
        results["bwd"] = run_plans("bwd", bg, bbuilt, bpack, bws, handle, bcheck, timer, [dqkv])
        print_plans("bwd", results["bwd"], bbuilt)
        del bws

    te_line = "TE: not timed"
    if te is not None:
        try:
            te_fwd, te_fwd_bwd, te_backend = time_te(te, H, D, timer)
            te_line = f"TE DotProductAttention [{te_backend}]: fwd {te_fwd:.1f} us, fwd+bwd {te_fwd_bwd:.1f} us per call"
        except Exception as err:  # noqa: BLE001
            te_line = f"TE: failed: {_reason(err)}"

    parts, saved_total = [], 0.0
    for label in ("fwd", "bwd"):
        best, first = fastest_vs_first(results.get(label, []))
        if best is None or first is None:
            parts.append(f"{label}: " + ("plan 0 did not run" if first is None else "no correct plan"))
            continue
        saved = first[2] - best[2]
        saved_total += max(saved, 0.0)
        if best[0] == 0:
            parts.append(f"{label}: plan 0 is the fastest correct plan ({first[2]:.1f} us)")
        else:
            parts.append(f"{label}: plan {best[0]} {best[2]:.1f} us vs plan 0 {first[2]:.1f} us, {saved:.1f} us/call "
                         f"saved = {saved * blocks / 1e3:.2f} ms per step at {blocks} blocks")
    print(f"  {shape} summary: " + "; ".join(parts)
          + f"; together {saved_total * blocks / 1e3:.2f} ms per step at {blocks} blocks | {te_line}")


# ----------------------------------------------------------------------------- main
def main() -> int:
    global cudnn
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="vit_b,vit_l,vit_h", help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds; the median round is printed")
    parser.add_argument("--runs", type=int, default=10, help="calls per timed batch")
    parser.add_argument("--modes", default="A,FALLBACK", help="cuDNN heuristic modes (cudnn.heur_mode names)")
    args = parser.parse_args()
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or args.rounds < 1 or args.runs < 1:
        parser.error(f"unknown shapes {unknown} (known: {', '.join(SHAPES)})" if unknown
                     else "rounds and runs must be >= 1")
    if not torch.cuda.is_available():
        print("sdpa_plans_bench: no CUDA device")
        return 1

    # Transformer Engine first: it must load its cuDNN before anything else does (the project's rule;
    # the frontend's import below dlopens libcudnn)
    try:
        import transformer_engine.pytorch as te
    except Exception as err:  # noqa: BLE001 - the cuDNN plans can still be timed without TE's reference
        print(f"sdpa_plans_bench: transformer_engine.pytorch did not import ({_reason(err)}); TE not timed")
        te = None
    try:
        import cudnn as _cudnn
    except Exception as err:  # noqa: BLE001
        print(f"sdpa_plans_bench: the cuDNN frontend (package nvidia-cudnn-frontend, module cudnn) did not import: "
              f"{_reason(err)}")
        return 2
    cudnn = _cudnn
    try:
        modes = [getattr(cudnn.heur_mode, m.strip()) for m in args.modes.split(",") if m.strip()]
    except AttributeError as err:
        parser.error(f"--modes: {err}")

    torch.zeros(1, device="cuda")  # CUDA context first: the handle binds the current device
    handle = cudnn.create_handle()
    # run on torch's current stream, where the CUDA events are recorded
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    te_cudnn = te.get_cudnn_version() if te is not None else "-"
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | cuDNN {cudnn.backend_version_string()} "
          f"(torch {torch.backends.cudnn.version()}, TE {te_cudnn}) | cudnn frontend {cudnn.__version__} | "
          f"modes {args.modes} | {args.rounds} rounds x {args.runs} runs")
    print("per plan: index (* = plan 0, the heuristic's first), GPU us per call (median of rounds), errors vs "
          "torch fp32 (fwd: rel. max of O and of stats; bwd: rel. L2, worst of dQ/dK/dV), workspace, "
          f"WRONG if an error > {WRONG_FACTOR:g}x plan 0's, plan name")

    torch.manual_seed(0)
    timer = GpuTimer(args.rounds, args.runs)
    if timer.sleep is None:
        print("sdpa_plans_bench: torch.cuda._sleep is missing: batches are not queued ahead, host gaps may count")
    for shape in shapes:
        bench_shape(shape, handle, modes, timer, te)
        torch.cuda.empty_cache()
    return 0  # the handle is left to the process exit: graphs freed later would still hold it


if __name__ == "__main__":
    sys.exit(main())
