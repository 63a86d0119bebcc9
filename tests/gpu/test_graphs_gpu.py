"""make_graphed_blocks on the GPU: graphed training equals eager training, FP8 state keeps
updating, mismatched calls fall back to eager with a warning, DDP and accumulation work.
Shapes captured as they come (the shape cache): test_graph_cache_gpu.py."""

import contextlib
import copy
import io
import os
import warnings

import pytest
import timm
import torch
import torch.nn.functional as F

import fp8vit
from helpers import assert_gradients_alike, assert_stage_graphs_train_like_eager, is_forward_gelu_kernel, snr_db

pytestmark = pytest.mark.gpu

B = 16  # 16 x 197 token rows: aligned for FP8


@pytest.fixture(autouse=True)
def _fresh_warnings():
    from fp8vit import _warn
    _warn._seen.clear()  # each test sees its own fallback warning


def _vit(depth=3):
    torch.manual_seed(0)
    model = timm.create_model("vit_base_patch16_224", pretrained=False, depth=depth, num_classes=10)
    return fp8vit.convert_to_te(model.cuda()).train()


def _data(n=4, batch=B):
    g = torch.Generator("cuda").manual_seed(1)
    return [(torch.randn(batch, 3, 224, 224, device="cuda", generator=g),
             torch.randint(0, 10, (batch,), device="cuda", generator=g)) for _ in range(n)]


def _train(model, data, recipe="delayed", accumulate=1, set_to_none=True):
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    losses = []
    for i, (x, y) in enumerate(data):
        with fp8vit.fp8_context(recipe):
            loss = F.cross_entropy(model(x), y) / accumulate
        loss.backward()
        losses.append(float(loss))
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
    return losses


def _fp8_scales(model):
    return [m.fp8_meta["scaling_fwd"].scale.clone() for m in model.modules()
            if isinstance(getattr(m, "fp8_meta", None), dict) and "scaling_fwd" in m.fp8_meta]


def _assert_same_parameters(eager, graphed):
    for (n, a), b in zip(eager.named_parameters(), graphed.parameters()):
        assert snr_db(a, b) > 40, n


def _assert_same_scales(eager, graphed):
    """Bit for bit the same delayed-scaling scales, which moved from their initial 1."""
    se, sg = _fp8_scales(eager), _fp8_scales(graphed)
    assert len(se) == len(sg) > 0 and not all(torch.all(s == 1) for s in sg)
    differ = [(i, float(((a - b).abs() / a.abs()).max())) for i, (a, b) in enumerate(zip(se, sg))
              if not torch.equal(a, b)]
    assert not differ, f"{len(differ)} of {len(se)} modules' forward scales differ (index, max rel diff): {differ[:8]}"


def _assert_same_training(eager, graphed):
    """Same parameters (SNR) and, bit for bit, the same delayed-scaling scales."""
    _assert_same_parameters(eager, graphed)
    _assert_same_scales(eager, graphed)


def _scaling_state(model):
    """Every TE module's forward and backward delayed-scaling scales, as one flat tensor (or None)."""
    parts = [m.fp8_meta[k].scale.flatten() for m in model.modules()
             if isinstance(getattr(m, "fp8_meta", None), dict) for k in ("scaling_fwd", "scaling_bwd")
             if k in m.fp8_meta and hasattr(m.fp8_meta[k], "scale")]
    return torch.cat(parts).clone() if parts else None


def _first_divergence(trail):
    """The first step or eval after which two models' scaling states differ, with how many entries."""
    for (name, a), (_, b) in zip(*trail):
        if a is not None and not torch.equal(a, b):
            return f"{name}: {int((a != b).sum())} of {a.numel()} scales differ"
    return "none"


def _grad_sequence(model, data, recipe="delayed", accumulate=1, set_to_none=True, states=None):
    """The gradients (clones) after every ``accumulate`` micro-batches, without optimizer steps.
    With ``states`` (a list), appends the scaling state after every micro-batch, named.

    For fused_wgrad, whose weight gradients are fp32 GEMM outputs where eager ones are bf16-rounded:
    over optimizer steps two such runs drift apart as FP8 amplifies the rounding (after 4 SGD steps
    of these tests, cls_token differs at 21 dB), so they are compared at fixed weights; the replays,
    the gradient buffers' reuse and the FP8 state still go through every step.
    """
    seq = []
    for i, (x, y) in enumerate(data):
        with fp8vit.fp8_context(recipe):
            loss = F.cross_entropy(model(x), y) / accumulate
        loss.backward()
        if states is not None:
            states.append((f"micro-batch {i} (batch {len(y)})", _scaling_state(model)))
        if (i + 1) % accumulate == 0:
            seq.append({n: p.grad.clone() for n, p in getattr(model, "module", model).named_parameters()})  # DDP: .module
            model.zero_grad(set_to_none=set_to_none)
    return seq


def _assert_same_gradients(eager_seq, graphed_seq, trail=None):
    """:func:`helpers.assert_gradients_alike`, saying with ``trail`` (both models' scaling states
    per micro-batch) where the scaling states first differ."""
    where = f"; scaling state first differs after: {_first_divergence(trail)}" if trail else ""
    assert_gradients_alike(eager_seq, graphed_seq, where)


@pytest.mark.parametrize("triton_dbias", [True, False], ids=["fp8vit-dbias", "te-dbias"])
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_graphed_training_matches_eager(recipe, triton_dbias):
    # fused_wgrad=False: the graphs run exactly the eager kernels (the bias gradients on the kernel
    # the graphs captured, fp8vit's or TE's), so training over optimizer steps must match, FP8
    # scales bit for bit.
    data = _data()
    eager, graphed = _vit(), _vit()
    with fp8vit._te.bias_grad_kernel(triton_dbias):
        handle = fp8vit.make_graphed_blocks(graphed, B, recipe=recipe, fused_wgrad=False, triton_dbias=triton_dbias)
        assert not handle.fused_wgrad
        le, lg = _train(eager, data, recipe), _train(graphed, data, recipe)
    print(f"{recipe}: eager losses {le}, graphed {lg}")
    assert handle.replays == len(data) and handle.eager_calls == 0
    _assert_same_parameters(eager, graphed)
    if recipe == "delayed":  # the scales moved while replaying, identically
        _assert_same_scales(eager, graphed)


def test_replays_skip_tes_module_walk():
    # Lever 41: TE 2.20's graphed forward walks every submodule per call; the graph cache replays
    # through fp8vit._te.lean_graphed_forward instead, which knows that forward by its code. A TE
    # whose forward differs gets its own forward back (same results, the walk kept): this fails then.
    model = _vit()
    handle = fp8vit.make_graphed_blocks(model, B)
    forwards = [type(f).__name__ for entry in handle.shapes for f in entry._graphed]
    assert forwards and set(forwards) == {"_LeanForward"}, forwards
    # lever 58: with the stem in the graphs the forward graph replays before that host work, where
    # TE's graphed function is the one fp8vit knows (a TE whose function differs keeps TE's order)
    assert handle.stem and all(entry._graphed[0]._early is not None for entry in handle.shapes)
    losses = _train(model, _data(2))
    assert handle.replays == 2 and handle.eager_calls == 0 and all(map(torch.isfinite, map(torch.tensor, losses)))


@pytest.mark.parametrize("accumulate,set_to_none", [(1, True), (2, True), (2, False)],
                         ids=["zero_grad-none", "accumulate2-zero_grad-none", "accumulate2-zero_grad-zeros"])
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fused_wgrad_gradients_match_eager(recipe, accumulate, set_to_none):
    # The default graphs (fused_wgrad=True) over several replays, with accumulation over
    # micro-batches (a p.grad still aliasing a gradient buffer when the next replay rewrites it)
    # and both zero_grad modes: every parameter's gradient as eager training's.
    data = _data(6)
    eager, graphed = _vit(), _vit()
    handle = fp8vit.make_graphed_blocks(graphed, B, recipe=recipe)
    assert handle.fused_wgrad
    ge = _grad_sequence(eager, data, recipe, accumulate, set_to_none)
    gg = _grad_sequence(graphed, data, recipe, accumulate, set_to_none)
    assert handle.replays == len(data) and handle.eager_calls == 0
    _assert_same_gradients(ge, gg)
    if recipe == "delayed":  # same weights, same tensors: the same FP8 scales, bit for bit
        _assert_same_scales(eager, graphed)


@pytest.mark.parametrize("lazy", [False, True], ids=["captured-up-front", "captured-at-second-step"])
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_stem_in_the_graphs_gives_every_gradient_as_eager(recipe, lazy):
    # Lever 55: the stem (patch GEMM, class token, position embedding) and the final norm in the
    # blocks' graphs (fused_wgrad, the default), keyed on the images: every parameter's gradient,
    # the stem's included (a graph that dropped one leaves its .grad None: the clone fails), as
    # eager's over several replays, and the FP8 scales bit for bit.
    data = _data(5)
    eager, graphed = _vit(), _vit()
    handle = fp8vit.make_graphed_blocks(graphed, None if lazy else B, recipe=recipe, stem=True)
    ge = _grad_sequence(eager, data, recipe)
    gg = _grad_sequence(graphed, data, recipe)
    assert handle.stem and [s.shape for s in handle.shapes] == [(B, 3, 224, 224)]
    assert handle.replays == len(data) - lazy and handle.eager_calls == lazy
    _assert_same_gradients(ge, gg)
    if recipe == "delayed":
        _assert_same_scales(eager, graphed)
    with torch.no_grad():  # eval: eager, the same output
        assert snr_db(eager.eval()(data[0][0]), graphed.eval()(data[0][0])) > 40


def test_a_hook_on_the_final_norm_takes_a_default_stem_out_and_the_blocks_stay_graphed():
    # stem=None (convert_to_te(cuda_graphs=True)'s default): the stem joined the graphs; a forward
    # hook added later on the final norm (features for a loss) runs every step from then on, the
    # blocks are captured alone, and every gradient matches eager's through the switch
    from fp8vit.training.graphs import graphed_modules
    data = _data(6)
    eager = _vit()
    torch.manual_seed(0)  # as _vit's
    timm_model = timm.create_model("vit_base_patch16_224", pretrained=False, depth=3, num_classes=10)
    graphed = fp8vit.convert_to_te(timm_model.cuda(), cuda_graphs=True).train()
    handle = fp8vit.GraphedBlocks.of(graphed)
    assert handle.stem
    seen = []
    ge = _grad_sequence(eager, data[:2]) + _grad_sequence(eager, data[2:])
    gg = _grad_sequence(graphed, data[:2])
    assert handle.replays == 1 and [s.shape for s in handle.shapes] == [(B, 3, 224, 224)]
    graphed.norm.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    with pytest.warns(RuntimeWarning, match="blocks alone"):
        gg += _grad_sequence(graphed, data[2:])
    assert not handle.stem and graphed_modules(graphed) == ["blocks"] and len(seen) == 4
    # step 3 switched (eager: the blocks' tokens noted), step 4 captured and replayed them, 5 and 6 replayed
    assert [s.shape for s in handle.shapes] == [(B, 197, 768)] and handle.replays == 1 + 3
    _assert_same_gradients(ge, gg)


def test_vector_parameters_are_cast_by_one_kernel_each_way_with_the_same_bits(monkeypatch):
    # lever 42: TE casts each norm weight and bias and each GEMM bias to bf16 per forward (8 a ViT
    # block) and autograd casts each gradient back; fp8vit._te.cast_small_params makes those
    # copies with one multi-tensor kernel each way. The same roundings: bit-identical training.
    from torch.profiler import ProfilerActivity, profile
    from fp8vit.blocks.backend import Backend
    from fp8vit.tools.profiling import trace_events, trace_kernels
    data = _data(3)
    copies, grads, losses = {}, {}, {}
    for together in (True, False):
        if not together:  # TE's own per-parameter casts
            monkeypatch.setattr(Backend, "cast_small_params", lambda self, block: contextlib.nullcontext())
        model = _vit()
        fp8vit.make_graphed_blocks(model, B)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        losses[together] = []
        for i, (x, y) in enumerate(data):  # observe, capture, replay: the last is profiled
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                with fp8vit.fp8_context():
                    loss = F.cross_entropy(model(x), y)
                loss.backward()
                torch.cuda.synchronize()
            losses[together].append(loss.item())
            if i < len(data) - 1:
                opt.step()
                opt.zero_grad(set_to_none=True)
        names = [k for k, _, _ in trace_kernels(trace_events(prof))]
        copies[together] = sum(1 for k in names if "copy_kernel" in k)
        grads[together] = {n: p.grad.clone() for n, p in model.blocks.named_parameters()}
    same = all(torch.equal(grads[True][n], g) for n, g in grads[False].items())
    print(f"copy kernels in a graphed ViT step (3 blocks): cast together {copies[True]}, each {copies[False]}; "
          f"losses {losses[True]} / {losses[False]}; gradients bit-identical: {same}")
    assert copies[False] - copies[True] >= 2 * 7 * 3, copies  # 8 vectors a block, each way
    assert losses[True][0] == losses[False][0]  # the first forward: the same kernels on the same inputs
    # later steps: equal but for atomics in attention's backward, if cuDNN runs any (>> 60 dB)
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)
    for n, g in grads[False].items():
        assert grads[True][n].dtype == g.dtype and snr_db(g, grads[True][n]) > 60, n


def test_fused_wgrad_writes_fp32_weight_gradients_without_cast_kernels():
    # fused_wgrad: TE's wgrad GEMM writes each block weight's gradient in fp32 into weight.main_grad,
    # which becomes p.grad uncopied; without it the GEMM writes bf16 and autograd runs one cast
    # kernel (direct_copy) per weight. 4 GEMM weights per block: qkv, proj, fc1, fc2.
    from torch.profiler import ProfilerActivity, profile
    from fp8vit.tools.profiling import trace_events, trace_kernels
    (x, y), = _data(1)
    casts, grads = {}, {}
    for fused in (False, True):
        model = _vit()
        fp8vit.make_graphed_blocks(model, B, fused_wgrad=fused)
        for i in range(2):  # the second step is profiled
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                with fp8vit.fp8_context():
                    loss = F.cross_entropy(model(x), y)
                loss.backward()
                torch.cuda.synchronize()
            if i == 0:
                model.zero_grad(set_to_none=True)
        casts[fused] = sum(1 for k, _, _ in trace_kernels(trace_events(prof)) if "direct_copy" in k)
        grads[fused] = {n: p for n, p in model.blocks.named_parameters()
                        if n.endswith(("qkv.weight", "proj.weight", "fc1_weight", "fc2_weight"))}
    print(f"direct_copy kernels per graphed step: bf16 wgrad {casts[False]}, fused {casts[True]}")
    assert len(grads[True]) == 4 * 3
    assert casts[False] - casts[True] >= 4 * 3, casts
    for n, p in grads[True].items():
        g, ref = p.grad, grads[False][n].grad
        assert g.dtype == torch.float32 and g.data_ptr() == p.main_grad.data_ptr(), n  # no copy
        # fp32 GEMM output: most values are not bf16 numbers; without fusion all of them are
        assert (g != g.bfloat16().float()).float().mean() > 0.5, n
        assert torch.equal(ref, ref.bfloat16().float()), n
        assert snr_db(ref, g) > 40, n  # the same gradient, up to bf16 rounding


def test_cudnn_layernorm_in_the_graphs_only():
    data = _data()
    eager, graphed = _vit(), _vit()
    # fused_wgrad=False: bit-identical FP8 scales to eager training (see _assert_same_training)
    handle = fp8vit.make_graphed_blocks(graphed, B, cudnn_layernorm=True, fused_wgrad=False)
    assert not fp8vit._te.cudnn_norm_enabled()  # restored after capture
    old = fp8vit.set_cudnn_layernorm(True)  # eager with the same kernels as the graphs
    try:
        _train(eager, data)
    finally:
        fp8vit.set_cudnn_layernorm(old)
    _train(graphed, data)
    assert handle.replays == len(data) and handle.eager_calls == 0
    # Captured with TE's own kernels instead, the amax (and so every FP8 rounding) would differ.
    _assert_same_training(eager, graphed)


@pytest.mark.parametrize("fused_wgrad", [False, True], ids=["bf16-wgrad", "fused-wgrad"])
def test_mlp_recompute_inside_the_graphs(fused_wgrad):
    # TE's LayerNormMLP(checkpoint=True) reruns LayerNorm, fc1 and GELU inside its own backward,
    # which the backward graph captures: graphed training must equal eager training with the same
    # blocks recomputing, and the replayed backward must really rerun fc1 and GELU (one more forward
    # GELU per recomputing block, counted in the profiler's trace).
    from torch.profiler import ProfilerActivity, profile
    from fp8vit.tools.profiling import trace_events, trace_kernels
    data = _data()
    eager, graphed, plain = _vit(), _vit(), _vit()
    for m in (eager, graphed):
        fp8vit.set_mlp_recompute(m, every=2)  # blocks 0 and 2 of 3
    handle = fp8vit.make_graphed_blocks(graphed, B, fused_wgrad=fused_wgrad)
    fp8vit.make_graphed_blocks(plain, B, fused_wgrad=fused_wgrad)
    if fused_wgrad:  # compared at fixed weights (see _grad_sequence)
        _assert_same_gradients(_grad_sequence(eager, data), _grad_sequence(graphed, data))
    else:
        _train(eager, data), _train(graphed, data)
        _assert_same_training(eager, graphed)
    assert handle.replays == len(data) and handle.eager_calls == 0
    counts = {}
    for name, model in (("recompute", graphed), ("plain", plain)):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            _train(model, data[:1])
            torch.cuda.synchronize()
        counts[name] = sum(1 for k, _, _ in trace_kernels(trace_events(prof)) if is_forward_gelu_kernel(k))
    print(f"forward GELU kernels per graphed step: {counts}")
    assert counts["plain"] == 3 and counts["recompute"] == 5, counts


@pytest.mark.parametrize("set_to_none", [True, False], ids=["zero_grad-none", "zero_grad-zeros"])
def test_gradient_accumulation_over_replays(set_to_none):
    # The backward graph rewrites the buffers that p.grad aliases: a gradient still set when the
    # next replay runs must be copied first, or the first micro-batch's gradient is lost.
    # With TE's gradient buffers (fused_wgrad=False, exact kernels); fused_wgrad's main_grad
    # buffers: test_fused_wgrad_gradients_match_eager.
    data = _data(4)
    eager, graphed = _vit(), _vit()
    fp8vit.make_graphed_blocks(graphed, B, fused_wgrad=False)
    _train(eager, data, accumulate=2, set_to_none=set_to_none)
    _train(graphed, data, accumulate=2, set_to_none=set_to_none)
    _assert_same_parameters(eager, graphed)  # each replay's gradients were added, not overwritten


def test_parameter_gradients_leave_the_graph_without_a_copy():
    # TE copies every parameter gradient out of the graph's buffers by default (one memcpy each);
    # fp8vit copies only a .grad that still points into them, just before a replay rewrites it.
    # Lightning sets the gradients to None between the forward and the backward: no weight gradient
    # to copy (copied before the forward, they were all copied: +4 ms, +2.3 GiB at ViT-H/16).
    # Per mode, the second of two steps: TE's own copies counted in a profile (DtoD memcpys), the
    # gradient copies fp8vit makes measured by the bytes allocated in the step beyond the
    # zero_grad(set_to_none=True) step's (the copies are one multi-tensor kernel, not memcpys).
    from torch.profiler import ProfilerActivity, profile
    (x, y), = _data(1)
    model = _vit()
    # the blocks alone: the bytes below are the blocks' gradients (a stem in the graphs adds its
    # patch weight's and position embedding's, copied like the biases': no main_grad)
    fp8vit.make_graphed_blocks(model, B, stem=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    n_params = sum(1 for _ in model.blocks.parameters())
    counts, allocated = {}, {}
    for mode in ("none", "zeros", "lightning"):
        # step 2 starts from what zero_grad left; "none" and "lightning" are alike from then on, so
        # the least of steps 2-3 there: a lazy one-off allocation (1.7 MB in the lightning step after
        # this file's earlier tests, on an H100) is not a copy. "zeros" copies at step 2 only (the
        # .grad are then copies, outside the graphs' buffers)
        for k in range(3):
            torch.cuda.synchronize()
            before = torch.cuda.memory_stats()["allocated_bytes.all.allocated"]
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                with fp8vit.fp8_context():
                    loss = F.cross_entropy(model(x), y)
                if mode == "lightning":
                    opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.cuda.synchronize()
            step_bytes = torch.cuda.memory_stats()["allocated_bytes.all.allocated"] - before
            if k == 1 or (k == 2 and mode != "zeros"):
                allocated[mode] = min(allocated.get(mode, step_bytes), step_bytes)
            opt.step()
            if mode != "lightning":
                opt.zero_grad(set_to_none=mode == "none")
        counts[mode] = sum(1 for e in prof.events()
                           if str(e.device_type).endswith("CUDA") and "Memcpy DtoD" in e.name)
    grads = [p.grad for p in model.blocks.parameters()]
    main = sum(g.numel() * g.element_size() for p, g in zip(model.blocks.parameters(), grads)
               if getattr(p, "main_grad", None) is not None and g.data_ptr() == p.main_grad.data_ptr())
    total = sum(g.numel() * g.element_size() for g in grads)
    extra = {m: allocated[m] - allocated["none"] for m in ("zeros", "lightning")}
    print(f"DtoD copies per step: zero_grad(set_to_none=True) {counts['none']}, False {counts['zeros']}, "
          f"between forward and backward {counts['lightning']}; {n_params} block parameters; bytes allocated "
          f"beyond set_to_none=True: False {extra['zeros']}, between {extra['lightning']}; block gradients "
          f"{total} bytes, {main} of them weight.main_grad views")
    assert counts["none"] < n_params // 4, "parameter gradients were copied out of the graph"
    assert main > total // 2, "the weight gradients are not views of main_grad"
    assert extra["zeros"] >= 0.9 * total, "a set .grad was not copied before the replay rewrote it"
    # Lightning: the biases' and norms' gradients are copied before the forward (their buffers are
    # in the graphs' pool), the weights' (main_grad: rewritten by the backward replay only) never
    assert extra["lightning"] <= total - main + (total - main) // 2 + 2**20, \
        "weight gradients set to None before the backward were copied"


def test_other_batch_shape_falls_back_to_eager_with_a_warning():
    # max_shapes=1: only the shape captured now (else another shape is captured at its second call)
    model = _vit()
    handle = fp8vit.make_graphed_blocks(model, B, max_shapes=1)
    ref = copy.deepcopy(_vit())  # an ungraphed twin with the same weights
    x = torch.randn(5, 3, 224, 224, device="cuda")  # the last, smaller batch of an epoch
    with pytest.warns(RuntimeWarning, match=r"run eagerly.*\[5, 3, 224, 224\].*\[16, 3, 224, 224\]"):
        with fp8vit.fp8_context("current"):
            out = model(x)
    with fp8vit.fp8_context("current"):
        expected = ref(x)
    assert handle.eager_calls == 1 and handle.replays == 0
    assert snr_db(expected, out) > 40
    # Eagerly, TE computes and returns the weight gradients as usual (fused_wgrad is on for the
    # graphs only): every parameter gets its gradient.
    out.float().square().mean().backward()
    expected.float().square().mean().backward()
    for (n, a), b in zip(ref.named_parameters(), model.parameters()):
        assert b.grad is not None and snr_db(a.grad, b.grad) > 40, n


def test_outside_fp8_context_runs_eagerly_and_eval_is_silent():
    model = _vit()
    handle = fp8vit.make_graphed_blocks(model, B)
    x = _data(1)[0][0]
    with pytest.warns(RuntimeWarning, match=r"runs without FP8 \(outside fp8_context"):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(x)
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad(), fp8vit.fp8_context("delayed"):
            model(x)
    assert handle.eager_calls == 2 and handle.replays == 0


def test_refusals_name_the_problem():
    model = _vit()
    model.set_grad_checkpointing(True)
    with pytest.raises(ValueError, match="checkpointing"):
        fp8vit.make_graphed_blocks(model, B)
    model.set_grad_checkpointing(False)
    handle = fp8vit.make_graphed_blocks(model, B)
    with pytest.raises(ValueError, match="already graphed"):
        fp8vit.make_graphed_blocks(model, B)
    twin = copy.deepcopy(model)  # e.g. an EMA: the settings come along, not the graphs (they read model's weights)
    twin_handle = fp8vit.GraphedBlocks.of(twin)
    assert twin_handle is not handle and twin_handle.shapes == [] and len(handle.shapes) == 1
    assert not any(hasattr(p, "main_grad") for p in twin.parameters())
    torch.save(model.state_dict(), io.BytesIO())  # the weights save as usual
    assert handle.fused_wgrad and sum(hasattr(p, "main_grad") for p in model.parameters()) == 4 * 3
    handle.release()
    assert not any(hasattr(p, "main_grad") for p in model.parameters())  # buffers gone
    copy.deepcopy(model)  # eager again: the model copies (e.g. for an EMA)


@pytest.mark.parametrize("bucket_view", [False, True], ids=["ddp", "ddp-gradient_as_bucket_view"])
def test_ddp_after_capture(tmp_path, bucket_view):
    import torch.distributed as dist
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(29533 + bucket_view)  # a fresh store per parametrization
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        data = _data(3)
        plain, graphed, exact = _vit(), _vit(), _vit()
        fp8vit.make_graphed_blocks(graphed, B)  # fused_wgrad: TE returns no weight gradient itself
        fp8vit.make_graphed_blocks(exact, B, fused_wgrad=False)
        ddp = torch.nn.parallel.DistributedDataParallel(graphed, device_ids=[torch.cuda.current_device()],
                                                        gradient_as_bucket_view=bucket_view)
        ddp_exact = torch.nn.parallel.DistributedDataParallel(exact, device_ids=[torch.cuda.current_device()],
                                                              gradient_as_bucket_view=bucket_view)
        # DDP's hooks fire for the main_grad weights and the reduced gradients are the eager ones...
        _assert_same_gradients(_grad_sequence(plain, data), _grad_sequence(ddp, data))
        # ... and over optimizer steps (exact kernels), DDP trains as plain training.
        plain2 = _vit()
        _train(plain2, data), _train(ddp_exact, data)
        _assert_same_parameters(plain2, exact)
    finally:
        dist.destroy_process_group()


def test_crossvit_branches_train_like_eager():
    # CrossViT's MultiScaleBlocks take a list of two branches' tokens: each branch (an nn.Sequential
    # of fp8vit blocks, one tensor in) gets its own graph cache, 3 blocks x 2 branches.
    def make():
        torch.manual_seed(0)
        return timm.create_model("crossvit_tiny_240", pretrained=False, num_classes=100).cuda()

    assert_stage_graphs_train_like_eager(make, fp8vit.convert_to_te, stages=6, img_size=240)
