"""convert_to_te(fallback="compile"): the blocks fp8vit cannot fuse, compiled in place, a Sequential
of them only as one unit (CPU, reference backend, torch.compile's default backend on tiny models)."""

import copy
import warnings

import pytest
import torch
from timm.models.vision_transformer import Block, ResPostBlock, VisionTransformer

import fp8vit
from fp8vit.blocks import compiled as compiled_mod
from fp8vit.blocks.compiled import compile_units, is_compiled_at, is_compiled_block


def _unfused():
    torch.manual_seed(0)  # a ViT of ResPostBlocks (Swin V2's post-norm order): a block fp8vit does not fuse
    return VisionTransformer(img_size=32, patch_size=16, embed_dim=64, depth=2, num_heads=2, num_classes=5,
                             block_fn=ResPostBlock)


def _convert(model, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the backend note (no TE here)
        return fp8vit.convert_to_te(model, backend="reference", fallback="compile", **kw)


def test_compile_fallback_matches_eager_forward_and_backward():
    torch._dynamo.reset()
    model = _unfused()
    ref = copy.deepcopy(model)
    keys = list(model.state_dict())
    params = [id(p) for p in model.parameters()]
    assert _convert(model) is model
    summary = fp8vit.conversion_summary(model)
    assert summary.fallback == "compile" and summary.num_compiled == 2 and summary.num_kept == 0
    assert summary.compiled_paths == ("blocks.0", "blocks.1")
    assert "compiled (torch.compile)" in summary.table() and "compiled 2 blocks" in summary.short()
    assert summary.to_dict()["compiled"] == {"ResPostBlock: no fp8vit block for this class": ["blocks.0", "blocks.1"]}
    assert is_compiled_block(model.blocks) and not any(is_compiled_block(b) for b in model.blocks)  # one unit
    assert all(is_compiled_at(model, f"blocks.{i}") for i in range(2))
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params

    x = torch.randn(3, 3, 32, 32)
    torch._dynamo.utils.counters.clear()
    for m in (model, ref):
        m.train()
        m(x).square().sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the blocks did compile
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)

    assert fp8vit.convert_from_te(model) is model
    assert not any(is_compiled_block(m) for m in model.modules())
    assert all(m._compiled_call_impl is None for m in model.modules())
    assert not is_compiled_at(model, "blocks.0")
    assert list(model.state_dict()) == keys
    with pytest.raises(ValueError, match="was not converted"):
        fp8vit.conversion_summary(model)


def test_fused_blocks_stay_uncompiled_and_a_second_call_keeps_the_compilation():
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=16, embed_dim=64, depth=2, num_heads=2, num_classes=5)
    model.blocks[1] = ResPostBlock(64, 2)  # no fp8vit block for it
    _convert(model)
    summary = fp8vit.conversion_summary(model)
    assert summary.num_fused == 1 and summary.compiled_paths == ("blocks.1",)
    assert not is_compiled_block(model.blocks[0]) and model.blocks[0]._compiled_call_impl is None
    guard = model.blocks[1]._compiled_call_impl
    _convert(model)  # converts what is left: nothing; the compiled block stays as it was
    assert fp8vit.conversion_summary(model).compiled_paths == ("blocks.1",)
    assert model.blocks[1]._compiled_call_impl is guard


def test_module_filter_keeps_a_block_uncompiled():
    model = _unfused()
    _convert(model, module_filter_fn=lambda mod, fqn: fqn != "blocks.0")
    summary = fp8vit.conversion_summary(model)
    assert summary.compiled_paths == ("blocks.1",) and dict(summary.kept) == {fp8vit.summary.EXCLUDED: ("blocks.0",)}
    assert not is_compiled_block(model.blocks[0]) and is_compiled_block(model.blocks[1])


def _failing_compile(fn, *args, **kwargs):
    def call(*a, **kw):
        raise torch._dynamo.exc.TorchRuntimeError("inductor could not lower aten.frobnicate")
    return call


def test_a_block_that_cannot_compile_warns_once_and_runs_eagerly(monkeypatch):
    monkeypatch.setattr(compiled_mod.torch, "compile", _failing_compile)
    model = _unfused().eval()
    ref = copy.deepcopy(model)
    _convert(model)
    x = torch.randn(2, 3, 32, 32)
    with pytest.warns(UserWarning, match=r"blocks \(Sequential of blocks 0, 1\) could not be compiled.*"
                                         r"TorchRuntimeError: inductor could not lower.*eagerly from now on") as record:
        out = model(x)
    assert len([w for w in record if "could not be compiled" in str(w.message)]) == 1  # one unit
    torch.testing.assert_close(out, ref(x))
    assert not is_compiled_block(model.blocks) and not is_compiled_at(model, "blocks.1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(model(x), ref(x))


def test_the_models_own_errors_are_raised_not_taken_for_compile_failures(monkeypatch):
    monkeypatch.setattr(compiled_mod.torch, "compile", _failing_compile)
    model = _unfused().eval()
    _convert(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError) as info:
            model.blocks(torch.randn(2, 5, 32))  # 32 features, the blocks want 64
    assert not isinstance(info.value, torch._dynamo.exc.TorchDynamoException)
    assert is_compiled_block(model.blocks)  # still compiled: the failure was the model's


def test_compile_is_a_fallback_choice():
    assert "compile" in fp8vit.FALLBACKS
    with pytest.raises(ValueError, match=r"'compile'"):
        fp8vit.convert_to_te(_unfused(), backend="reference", fallback="compiled")


def _eager_backend(monkeypatch):
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend="eager", **kw))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def _deep_unfused(depth=12):
    torch.manual_seed(0)
    return VisionTransformer(img_size=32, patch_size=16, embed_dim=32, depth=depth, num_heads=2, num_classes=5,
                             block_fn=ResPostBlock, drop_path_rate=0.2)  # a drop-path rate per block


def test_every_compiled_block_compiles_past_dynamo_recompile_limit(monkeypatch):
    # Blocks compiled one by one share one code object (nn.Module._call_impl); blocks whose guards
    # differ (a drop-path rate per block, a Swin shift, another stage's width) are recompilations of
    # it, and dynamo stops at its recompile limit (8), running the rest eagerly. One fused block in
    # the Sequential keeps the other 12 from compiling as one unit.
    _eager_backend(monkeypatch)
    model = _deep_unfused(13)
    model.blocks[0] = Block(32, 2)  # fused
    _convert(model)
    assert fp8vit.conversion_summary(model).num_compiled == 12
    assert compile_units(model, [f"blocks.{i}" for i in range(1, 13)]) == [(f"blocks.{i}", ()) for i in range(1, 13)]
    model.train()(torch.randn(2, 3, 32, 32)).sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 12  # 8 before the limit was raised


def test_a_sequential_of_unfused_blocks_compiles_once_not_once_per_block(monkeypatch):
    # Swin-B's 24 blocks, compiled one by one, were 24 compilations of 65-90 s each on the H200 (a
    # drop-path rate per block is a guard); the Sequential that holds them traces them in one.
    _eager_backend(monkeypatch)
    model, ref = _deep_unfused(), _deep_unfused()
    _convert(model)
    assert fp8vit.conversion_summary(model).num_compiled == 12
    assert compile_units(model, [f"blocks.{i}" for i in range(12)]) == [("blocks", tuple(str(i) for i in range(12)))]
    x = torch.randn(2, 3, 32, 32)
    for m in (model, ref):
        torch.manual_seed(1)  # the same drop-path draws
        m.train()(x).sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


# ---------------------------------------------------------------- compile=True: the whole model
def _vit():
    torch.manual_seed(0)  # timm's Block: fused
    return VisionTransformer(img_size=32, patch_size=16, embed_dim=64, depth=2, num_heads=2, num_classes=5)


def _whole(model, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fp8vit.convert_to_te(model, backend="reference", exact_gelu=True, **kw)


def test_compile_true_compiles_the_model_around_its_fused_blocks():
    torch._dynamo.reset()
    model, plain = _vit().train(), _vit().train()
    _whole(plain)
    _whole(model, compile=True)
    assert is_compiled_block(model) and not any(is_compiled_block(b) for b in model.blocks)
    assert list(model.state_dict()) == list(plain.state_dict())  # in place: the same keys
    x = torch.randn(2, 3, 32, 32)
    out, ref = model(x), plain(x)
    torch.testing.assert_close(out, ref)
    out.square().mean().backward(), ref.square().mean().backward()
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)
    summary = fp8vit.conversion_summary(model)
    assert summary.model_compiled and "the model compiled around them" in summary.short()
    impl = model._compiled_call_impl
    _whole(model, compile=True)  # converting again keeps the compilation (and dynamo's cache)
    assert model._compiled_call_impl is impl
    fp8vit.convert_from_te(model)
    assert model._compiled_call_impl is None


def test_compile_true_without_graphs_warns_once_at_the_call_that_eager_blocks_measured_slower():
    # cuda_graphs=False: the fused blocks stay eager inside the compiled model
    # at the call, not at the conversion: make_graphed_blocks(model, batch_size) may still come
    from fp8vit import _warn
    _warn._seen.clear()
    torch._dynamo.reset()
    model = _vit()
    said = []
    for step in ("convert", "call", "call"):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if step == "convert":
                fp8vit.convert_to_te(model, backend="reference", exact_gelu=True, compile=True, cuda_graphs=False)
            else:
                model(torch.randn(2, 3, 32, 32))
        said.append([str(w.message) for w in seen if "cuda_graphs=True" in str(w.message)])
    assert [len(s) for s in said] == [0, 1, 0] and "measured slower than not compiling" in said[1][0]


def test_compile_true_graphs_the_fused_blocks_unless_told_not_to():
    # Fused blocks left eager inside a compiled model are host-bound (ViT-B/16 on an H200: 80.7 ms
    # a step, 28.9 with CUDA graphs: docs/results/tests/gpu_suite_h200.log), so compile=True sets up
    # the graphs too (captured on the GPU at a shape's second step), the ViT's stem with them as
    # with cuda_graphs=True (lever 65); cuda_graphs=False keeps them eager; without compile nothing
    # changes. A model with nothing fused gets no graphs.
    from fp8vit.training.graphs import graphed_modules
    torch._dynamo.reset()
    for kw, want in ((dict(compile=True), [""]), (dict(compile=True, cuda_graphs=False), []),
                     (dict(), []), (dict(cuda_graphs=True), [""])):  # "": the ViT, its stem graphed too
        model = _vit()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            fp8vit.convert_to_te(model, backend="reference", exact_gelu=True, **kw)
        assert graphed_modules(model) == want, kw
        assert not [w for w in seen if "cuda_graphs" in str(w.message) or "compile=True" in str(w.message)], kw
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unfused = fp8vit.convert_to_te(_unfused(), backend="reference", compile=True)
    assert graphed_modules(unfused) == []
    with pytest.raises(TypeError, match="cuda_graphs"):
        fp8vit.convert_to_te(_vit(), backend="reference", cuda_graphs=1)


def test_compile_true_on_a_model_with_nothing_fused_compiles_it_only():
    torch._dynamo.reset()
    model = _unfused().eval()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fp8vit.convert_to_te(model, backend="reference", compile=True)
    said = " ".join(str(w.message) for w in seen)
    assert "compile=True compiled it, nothing runs in FP8" in said and "not faster converted" not in said
    assert is_compiled_block(model)
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(model(x), ref(x))


def test_a_model_that_cannot_compile_warns_once_and_runs_eagerly(monkeypatch):
    monkeypatch.setattr(compiled_mod.torch, "compile", _failing_compile)
    model = _vit().eval()
    ref = copy.deepcopy(model)
    _whole(ref)
    _whole(model, compile=True)
    x = torch.randn(2, 3, 32, 32)
    with pytest.warns(UserWarning, match=r"<model> \(VisionTransformer\) could not be compiled "
                                         r"\(convert_to_te\(compile=True\)\): TorchRuntimeError"):
        out = model(x)
    torch.testing.assert_close(out, ref(x))
    assert not is_compiled_block(model) and not fp8vit.conversion_summary(model).model_compiled


@pytest.mark.parametrize("kw, err, match", [
    (dict(compile=1), TypeError, "compile"),
    (dict(compile=True, fallback="compile"), ValueError, "pass one"),
])
def test_compile_true_refusals_change_nothing(kw, err, match):
    model = _vit()
    before = [type(b) for b in model.blocks]
    with pytest.raises(err, match=match):
        fp8vit.convert_to_te(model, backend="reference", **kw)
    assert [type(b) for b in model.blocks] == before and not is_compiled_block(model)


def test_compile_true_on_a_block_is_refused():
    block = _vit().blocks[0]
    with pytest.raises(ValueError, match="is a block itself"):
        fp8vit.convert_to_te(block, backend="reference", compile=True)
