"""What the microbenchmarks in docs/perf share: time one forward + backward call (the host waiting
for each), or say why a kernel path refused the inputs; time one call in a CUDA graph (no host
costs, as in a graphed step); the error against a reference."""

from typing import Callable, Optional

import torch

from fp8vit.tools.timing import median_ms

# The classic ViTs the kernel microbenchmarks size their tensors by: width and depth, and the token
# rows of a batch-128 step at 224 px (197 tokens an image)
VIT_WIDTHS = {"ViT-B/16": (768, 12), "ViT-L/16": (1024, 24), "ViT-H/16": (1280, 32)}
STEP_ROWS = 128 * 197


def residual_stream(C: int, rows: int = STEP_ROWS):
    """``(x, w, b)``: a ViT residual stream ``[rows, C]`` (per-row offsets and a few large channels,
    as ViT blocks carry) and a LayerNorm's weight and bias near 1 and 0, all bf16 on the GPU."""
    x = torch.randn(rows, C, device="cuda") + torch.randn(rows, 1, device="cuda") * 2
    x[:, :4] *= 20
    w = 1 + 0.1 * torch.randn(C, device="cuda")
    b = 0.1 * torch.randn(C, device="cuda")
    return x.to(torch.bfloat16), w.to(torch.bfloat16), b.to(torch.bfloat16)


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


def per_call_ms(fn, calls=20, reps=30):
    """One call's GPU time: ``calls`` calls captured in a CUDA graph (no host launch costs, as in a
    graphed training step), median of ``reps`` timed replays, divided by ``calls``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up off the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):  # the stream whose per-stream state the warm-up set up
        for _ in range(calls):
            fn()
    times = []
    for i in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]
