"""Kernel-name categories and the per-step breakdown (the GPU profile itself needs a GPU)."""

import pytest

from fp8vit.tools.profiling import categorize, kernel_breakdown, kernel_table


@pytest.mark.parametrize("name, cat", [
    ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128", "gemm"),
    ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN", "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention"),
    ("void transformer_engine::cast_transpose_kernel<...>", "fp8 cast/transpose/amax"),
    ("void transformer_engine::normalization::ln_fwd_tuned_kernel<...__nv_fp8_e4m3>", "layernorm (+fp8 cast)"),
    ("void transformer_engine::unary_kernel<16, true, float, Empty, &gelu<float, float>, __nv_fp8_e4m3>",
     "activation (+fp8 cast)"),
    ("void cudnn::fusion::convert_dq_to_16bits<true>(void const*)", "attention"),
    ("cudnn_generated_layer_norm_bwd_1_4_1_16_0", "layernorm (+fp8 cast)"),  # cuDNN LayerNorm (ViT-H)
    ("cudnn_generated_layer_norm_bwd_finalize_1_4_1_16_0", "layernorm (+fp8 cast)"),
    ("ln_tma_fwd_kernel", "layernorm (+fp8 cast)"),
    ("void at::native::(anonymous namespace)::fused_sgd_kernel", "optimizer"),
    ("void at::native::vectorized_elementwise_kernel<4, ...>", "elementwise/copy"),
    ("aten::addmm", "gemm"),
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::"
     "direct_copy_kernel_cuda(at::TensorIteratorBase&)>", "elementwise/copy"),
    ("some_new_kernel", "other"),
])
def test_categorize(name, cat):
    assert categorize(name) == cat


def test_breakdown_per_step_and_total():
    br = kernel_breakdown([("gemm_a", 3000.0), ("flash_fwd", 1000.0), ("mystery", 2000.0)], steps=2)
    assert br == {"gemm": 1.5, "attention": 0.5, "other": 1.0, "total": 3.0}


def test_kernel_table_groups_by_kernel_and_launching_op():
    launches = [("fill", "attn > aten::zeros > aten::fill_", 50.0)] * 6 + [("fill", "opt > aten::fill_", 10.0)] * 2 \
        + [("gemm", "linear", 300.0)] * 4
    rows = kernel_table(launches, steps=2)
    assert rows[0] == ("gemm", "linear", 2.0, 0.6)
    assert rows[1] == ("fill", "attn > aten::zeros > aten::fill_", 3.0, 0.15)
    assert rows[2] == ("fill", "opt > aten::fill_", 1.0, 0.01)


def test_idle_gaps_merges_overlaps_and_names_the_neighbours():
    from fp8vit.tools.profiling import idle_gaps
    # a [0, 10), b [5, 12) overlaps a; gap 12 -> 20; c [20, 30); d [21, 25) inside c; gap 30 -> 31; e [31, 32)
    kernels = [("c", 20.0, 10.0), ("a", 0.0, 10.0), ("b", 5.0, 7.0), ("d", 21.0, 4.0), ("e", 31.0, 1.0)]
    busy, span, gaps = idle_gaps(kernels)
    assert (busy, span) == (12.0 + 10.0 + 1.0, 32.0)
    assert gaps == [(8.0, "b", "c", 12.0), (1.0, "c", "e", 30.0)]
    assert idle_gaps([]) == (0.0, 0.0, [])


def test_trace_kernels_reads_gpu_work_once_from_the_chrome_trace():
    import json
    from fp8vit.tools.profiling import trace_events, trace_kernels

    class FakeProfile:  # what torch.profiler writes: CPU ops, runtime calls and GPU activity
        def export_chrome_trace(self, path):
            events = [{"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 9},
                      {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 1, "dur": 2},
                      {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 10, "dur": 5},
                      {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 16, "dur": 1},
                      {"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": 18, "dur": 0.5},
                      {"ph": "i", "cat": "kernel", "name": "marker", "ts": 20}]
            with open(path, "w") as f:
                json.dump({"traceEvents": events}, f)

    assert trace_kernels(trace_events(FakeProfile())) == [("gemm", 10.0, 5.0), ("Memcpy DtoD", 16.0, 1.0), ("Memset", 18.0, 0.5)]


def test_host_ops_are_the_outermost_per_thread_and_fill_a_gap():
    from fp8vit.tools.profiling import host_during, trace_events, trace_host_ops

    class FakeProfile:
        def export_chrome_trace(self, path):
            import json
            events = [  # thread 1: a range holding two ops, then an op; thread 2: one op
                {"ph": "X", "cat": "user_annotation", "name": "fp8vit::graphed_blocks", "ts": 100, "dur": 50,
                 "pid": 1, "tid": 1},
                {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 110, "dur": 5, "pid": 1, "tid": 1},
                {"ph": "X", "cat": "cpu_op", "name": "aten::empty", "ts": 120, "dur": 2, "pid": 1, "tid": 1},
                {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 160, "dur": 10, "pid": 1, "tid": 1},
                {"ph": "X", "cat": "cpu_op", "name": "aten::mul", "ts": 112, "dur": 4, "pid": 1, "tid": 2},
                {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 90, "pid": 0, "tid": 7},
                {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 161, "dur": 3, "pid": 1,
                 "tid": 1}]
            with open(path, "w") as f:
                json.dump({"traceEvents": events}, f)

    ops = trace_host_ops(trace_events(FakeProfile()))
    assert ops == [("fp8vit::graphed_blocks", 100.0, 50.0), ("aten::mul", 112.0, 4.0), ("aten::add", 160.0, 10.0)]
    # a GPU gap [90, 180): the range 50 us, the add 10, the other thread's mul 4; 26 us in no op
    assert host_during(ops, 90.0, 180.0) == [("fp8vit::graphed_blocks", 50.0), ("aten::add", 10.0),
                                            ("aten::mul", 4.0), ("(between ops)", 26.0)]
    assert host_during(ops, 0.0, 10.0) == [("(between ops)", 10.0)]


def test_synchronized_steps_split_into_lead_gaps_busy_and_tail():
    from fp8vit.tools.profiling import STEP_RANGE, step_exposure, step_windows
    events = [  # two --sync step ranges on the host; another range and a kernel-side annotation ignored
        {"ph": "X", "cat": "user_annotation", "name": STEP_RANGE, "ts": 200, "dur": 100},
        {"ph": "X", "cat": "user_annotation", "name": STEP_RANGE, "ts": 0, "dur": 100},
        {"ph": "X", "cat": "user_annotation", "name": "fp8vit::graphed_blocks", "ts": 10, "dur": 5},
        {"ph": "X", "cat": "gpu_user_annotation", "name": STEP_RANGE, "ts": 1, "dur": 90}]
    windows = step_windows(events)
    assert windows == [(0.0, 100.0), (200.0, 300.0)]
    # step 1: idle 0 -> 20 (the host's first launches), a [20, 50), gap 50 -> 60, b [60, 90), tail 90 -> 100
    # step 2: idle 200 -> 210, c [210, 290) with d inside it, tail 290 -> 300; e between the steps: no step's
    kernels = [("a", 20.0, 30.0), ("b", 60.0, 30.0), ("c", 210.0, 80.0), ("d", 220.0, 5.0), ("e", 150.0, 10.0)]
    ex, gaps = step_exposure(kernels, windows)
    assert ex == {"step": 100.0, "busy": (60.0 + 80.0) / 2, "lead": (20.0 + 10.0) / 2, "gaps": 5.0, "tail": 10.0}
    assert gaps == [(10.0, "a", "b", 50.0)]
    # each window adds up: lead + busy + gaps + tail = step
    assert ex["lead"] + ex["busy"] + ex["gaps"] + ex["tail"] == ex["step"]
    assert step_exposure(kernels, []) == ({"step": 0.0, "busy": 0.0, "lead": 0.0, "gaps": 0.0, "tail": 0.0}, [])


def test_profile_runs_synchronized_steps_on_the_cpu(capsys):
    # no GPU: CPU ops' time; --sync times each step alone (the bench's synchronized median)
    from fp8vit.tools.profiling import main
    assert main(["--model", "vit_tiny_patch16_224", "--batch-size", "2", "--variant", "timm-bf16", "--steps", "2",
                 "--warmup", "1", "--sync"]) == 0
    out = capsys.readouterr().out
    assert "ms/step (synchronized median, unprofiled), CPU op time" in out


def test_profile_builds_the_model_at_the_image_size_asked(capsys, monkeypatch):
    # --img-size reaches the model (PE-core-L's native 336 px, say): the tokens a step runs on change
    from fp8vit.tools import profiling
    built = []

    def build(*args, **kwargs):
        wl = workload.build_workload(*args, **kwargs)
        built.append(wl.model.patch_embed.img_size)
        return wl
    from fp8vit.tools import workload
    monkeypatch.setattr(profiling, "build_workload", build)
    assert profiling.main(["--model", "vit_tiny_patch16_224", "--batch-size", "1", "--img-size", "64",
                           "--variant", "timm-bf16", "--steps", "1", "--warmup", "1"]) == 0
    assert built == [(64, 64)]
    assert "vit_tiny_patch16_224 batch 1 at 64 px timm-bf16: wall" in capsys.readouterr().out


def test_profile_says_in_one_line_why_a_variant_cannot_run_here(capsys, monkeypatch):
    # The default variant (FP8) on a machine without FP8 raised FP8UnavailableError from inside the
    # first step; now the tool says why before building anything, and which variants do run here.
    import torch

    from fp8vit.tools import profiling
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(profiling, "build_workload", lambda *a, **k: pytest.fail("built a model it cannot run"))
    assert profiling.main(["--model", "vit_tiny_patch16_224", "--variant", "fp8vit-fp8-delayed"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fp8vit-profile: --variant fp8vit-fp8-delayed cannot run here: needs a CUDA GPU. "
                          "Variants that can: ")
    assert "timm-bf16" in err and "fp8vit-fp8-delayed-graphed" not in err
    with pytest.raises(SystemExit) as exc:
        profiling.main(["--variant", "timm-bf16", "--ncu-step"])
    assert exc.value.code == 2 and "--ncu-step marks a step for Nsight Compute: it needs a CUDA GPU" in capsys.readouterr().err
