"""make_graphed_blocks on the CPU: what it refuses before touching the model, and the shape cache's
policy (second-sight capture, the limit, its warnings, eval, requires_grad and switch changes, two
forwards before one backward, FSDP2, a failed capture, copies) with TE's capture replaced by a fake.

The fake stands where ``GraphedBlocks._run_capture`` calls TE's ``make_graphed_callables``: it
records what it was asked to capture and returns, per graphed module, a "graph" that doubles its
input through a custom autograd Function (TE's replay is one too). The GPU twin
(tests/gpu/test_graphs_gpu.py, test_graph_cache_gpu.py) checks the numerics with TE's real capture.
"""

import copy
import pickle
import warnings

import pytest
import timm
import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

import fp8vit
from fp8vit.training import graph_cache as GC
from fp8vit.training import graphs as G


def _vit(depth=2, **kw):
    torch.manual_seed(0)
    return fp8vit.convert_to_te(VisionTransformer(img_size=32, patch_size=16, embed_dim=64, depth=depth, num_heads=4,
                                                  num_classes=3), backend="reference", **kw)


def _eva():
    torch.manual_seed(0)
    model = timm.create_model("eva02_base_patch14_224", pretrained=False, img_size=56, embed_dim=64, num_heads=4,
                              depth=3, num_classes=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fp8vit.convert_to_te(model, backend="reference", exact_gelu=True)


def _images(batch, size=32):
    return torch.randn(batch, 3, size, size)


class _Delayed:
    """What fp8vit.training.graphs reads of a TE recipe: its name (recipe_name asks .delayed())."""

    def delayed(self):
        return True


class _Current:
    def float8_current_scaling(self):
        return True


def _fake_graph(target=None):
    """A fake graph replay, like TE's: a custom autograd Function that writes a static output
    buffer and returns it detached (the same storage every replay). Blocks (no ``target``): it
    doubles its input; a stem-and-blocks graph: the features module's own forward, images in."""
    static, scale = [], 2 if target is None else 1

    class Replay(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            if not static:
                static.append(torch.empty_like(x))
            static[0].copy_(x * scale)
            return static[0].detach()

        @staticmethod
        def backward(ctx, g):
            return g * scale

    if target is None:
        return lambda x, **kw: Replay.apply(x)
    return lambda x, **kw: Replay.apply(type(target).forward(target, x))


class _FakeTE:
    """Replaces TE's capture and the call's environment (GPU, autocast, FP8 recipe)."""

    def __init__(self, monkeypatch):
        self.captures = []
        self.recipe = _Delayed()
        self.dtype = torch.bfloat16
        self.oom = False
        fake = self

        def run_capture(handle, samples, sample_kwargs, recipe, dtype, first):
            if fake.oom:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            fake.captures.append(dict(shape=tuple(samples[0][0].shape), dtypes=[s[0].dtype for s in samples],
                                      kwargs=sample_kwargs, recipe=recipe, dtype=dtype, first=first,
                                      requires_grad=samples[0][0].requires_grad))
            graphed = tuple(_fake_graph(t if handle.stem else None) for t in handle._targets)
            return graphed, 1000 * samples[0][0].shape[0], True, ()

        monkeypatch.setattr(G.GraphedBlocks, "_run_capture", run_capture)
        monkeypatch.setattr(G.GraphedBlocks, "_on_gpu", staticmethod(lambda t: True))
        monkeypatch.setattr(G.GraphedBlocks, "_call_context", lambda handle: (fake.dtype, fake.recipe))

    @property
    def shapes(self):
        return [c["shape"] for c in self.captures]


@pytest.fixture
def fake(monkeypatch):
    from fp8vit import _warn
    _warn._seen.clear()  # each test sees its own warnings
    return _FakeTE(monkeypatch)


def _step(model, batch, size=32):
    out = model(_images(batch, size))
    out.float().sum().backward()
    return out


def _messages(record):
    return [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]


# --------------------------------------------------------------------------- refusals (no fake)
def test_needs_a_vit_with_sequential_blocks():
    with pytest.raises(ValueError, match="Linear has no nn.Sequential or nn.ModuleList .blocks."):
        fp8vit.make_graphed_blocks(torch.nn.Linear(4, 4), 8)


def test_needs_the_model_on_a_gpu_to_capture_a_batch_size_now():
    with pytest.raises(ValueError, match="blocks are on cpu.*model.cuda"):
        fp8vit.make_graphed_blocks(_vit(), 8, fp8=False)
    handle = fp8vit.make_graphed_blocks(_vit())  # no batch size: nothing to capture yet, no GPU needed
    assert handle.shapes == [] and handle.max_shapes == G.MAX_SHAPES


def test_tokens_per_image_without_patch_embed_num_patches_must_be_given():
    model = _vit()
    model.patch_embed = torch.nn.Identity()  # a ViT-like model whose stem says nothing about tokens
    with pytest.raises(ValueError, match="VisionTransformer has no patch_embed.num_patches .*pass tokens="):
        fp8vit.make_graphed_blocks(model, 8, fp8=False)
    with pytest.raises(ValueError, match="blocks are on cpu"):  # given: the next check is reached
        fp8vit.make_graphed_blocks(model, 8, tokens=5, fp8=False)


def test_dtype_must_be_an_autocast_dtype():
    with pytest.raises(ValueError, match="dtype=torch.float32"):
        fp8vit.make_graphed_blocks(_vit(), 8, dtype=torch.float32)


def test_checkpointing_and_unfused_recompute_are_refused_at_setup():
    model = _vit()
    model.set_grad_checkpointing(True)
    with pytest.raises(ValueError, match="checkpointing is on"):
        fp8vit.make_graphed_blocks(model)
    model = _vit(exact_gelu=True)
    fp8vit.set_mlp_recompute(model)
    with pytest.raises(ValueError, match="MLP recompute is on in blocks .*unfused"):
        fp8vit.make_graphed_blocks(model)


def test_hooks_on_the_graphed_modules_are_set_aside_for_the_capture_and_run_around_replays(fake):
    # TE refuses to capture a module with hooks (NonFiniteGuard's on EVA's blocks, a profiler's):
    # they are put aside while it captures, and run around every call as before.
    block = torch.nn.Linear(2, 2)
    fwd = block.register_forward_hook(lambda m, a, o: None)
    pre = block.register_forward_pre_hook(lambda m, a: None)
    with GC._hooks_set_aside((block,)):
        assert not (block._forward_hooks or block._forward_pre_hooks or block._backward_hooks)
    assert fwd.id in block._forward_hooks and pre.id in block._forward_pre_hooks
    model = _eva()
    handle = fp8vit.make_graphed_blocks(model)
    calls = []
    model.blocks[1].register_forward_hook(lambda m, a, o: calls.append(tuple(o.shape)))
    for _ in range(3):
        _step(model, 2, size=56)
    assert handle.replays == 6 and calls == [(2, 17, 64)] * 3


def test_a_keyword_input_that_requires_grad_is_captured_requiring_grad(fake):
    # Mixed RoPE's tables are made from learnable frequencies every forward: captured as constants,
    # the graphs would give the frequencies no gradient (silently). A fixed table stays a constant.
    torch.manual_seed(0)
    mixed = timm.create_model("vit_small_patch16_rope_mixed_224", pretrained=False, img_size=64, embed_dim=64,
                              num_heads=4, depth=3, num_classes=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp8vit.convert_to_te(mixed, backend="reference", exact_gelu=True)
    for model, grad in ((mixed, True), (_eva(), False)):
        fake.captures.clear()
        handle = fp8vit.make_graphed_blocks(model)
        size = 64 if model is mixed else 56
        _step(model, 2, size=size), _step(model, 2, size=size)
        cap, = fake.captures
        assert [k["rope"].requires_grad for k in cap["kwargs"]] == [grad] * 3
        assert handle.shapes[0].call_kwargs["rope"][2] is grad
        # captured up front (make_graphed_blocks(model, batch_size), CUDA only): the probe of what
        # the model passes its blocks sees the table as a training step makes it
        _, _, kwargs = G._block_calls(model, model.blocks, torch.device("cpu"), torch.bfloat16)
        assert kwargs["rope"].requires_grad is grad


# --------------------------------------------------------------------------- the shape cache
def test_a_shape_is_captured_at_its_second_training_step_and_replayed_from_then_on(fake):
    model = _vit()
    handle = fp8vit.make_graphed_blocks(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a loader's shapes are no reason to warn
        _step(model, 4)
        assert fake.shapes == [] and handle.eager_reasons == {"new shape": 1}
        _step(model, 4)
        assert fake.shapes == [(4, 3, 32, 32)] and handle.replays == 1
        _step(model, 4)
    assert fake.shapes == [(4, 3, 32, 32)] and handle.replays == 2 and handle.eager_calls == 1
    shape, = handle.shapes
    assert shape.shape == (4, 3, 32, 32) and shape.recipe_name == "delayed" and shape.autocast_dtype == torch.bfloat16
    assert shape.replays == 2 and shape.memory_bytes == 4000 and handle.memory_bytes == 4000
    assert handle.shape == (4, 3, 32, 32) and handle.recipe_name == "delayed"  # the first signature's
    assert fake.captures[0]["recipe"] is fake.recipe and fake.captures[0]["dtype"] == torch.bfloat16


def test_the_last_partial_batch_replays_from_the_second_epoch(fake):
    model = _vit()
    handle = fp8vit.make_graphed_blocks(model)
    epoch = [4, 4, 4, 3]  # 15 images, batch 4, drop_last=False
    for _ in range(3):
        for b in epoch:
            _step(model, b)
    assert fake.shapes == [(4, 3, 32, 32), (3, 3, 32, 32)]
    assert [s.replays for s in handle.shapes] == [2 + 3 + 3, 2]
    assert handle.eager_reasons == {"new shape": 2}  # the first sight of each, nothing else


def test_eval_runs_eagerly_silently_and_captures_nothing(fake):
    model = _vit()
    handle = fp8vit.make_graphed_blocks(model)
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            with torch.no_grad():
                model(_images(4))
    assert fake.captures == [] and handle.eager_reasons == {"eval": 3}
    model.train()
    _step(model, 4), _step(model, 4)
    model.eval()
    with torch.no_grad():
        model(_images(4))  # a captured shape: still eager in eval mode (TE captures for training)
    assert handle.replays == 1 and handle.eager_reasons["eval"] == 4


def test_a_no_grad_training_call_replays_but_never_captures(fake):
    model = _vit()
    handle = fp8vit.make_graphed_blocks(model)
    for _ in range(3):
        with torch.no_grad():
            model(_images(4))
    assert fake.captures == [] and handle.eager_reasons == {"no grad": 3}
    _step(model, 4), _step(model, 4)
    with torch.no_grad():
        model(_images(4))
    assert handle.replays == 2


def test_the_cache_holds_max_shapes_and_says_once_which_and_how_to_hold_more(fake):
    model = _vit()
    handle = fp8vit.make_graphed_blocks(model, max_shapes=2)
    for b in (4, 4, 3, 3):
        _step(model, b)
    assert fake.shapes == [(4, 3, 32, 32), (3, 3, 32, 32)]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            _step(model, 2)
    msg, = _messages(record)
    assert "met 3 distinct input signatures" in msg and "max_shapes=2" in msg
    assert "[[4, 3, 32, 32], [3, 3, 32, 32]]" in msg and "max_shapes = N" in msg and "memory_bytes" in msg
    assert fake.shapes == [(4, 3, 32, 32), (3, 3, 32, 32)] and handle.eager_reasons["cache full"] == 3
    handle.max_shapes = 3  # room again: the next call of the shape is captured
    _step(model, 2)
    assert fake.shapes[-1] == (2, 3, 32, 32) and len(handle.shapes) == 3


def test_a_shape_that_changes_every_step_captures_nothing_and_warns_once(fake):
    model = _vit()
    handle = fp8vit.make_graphed_blocks(model)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for b in range(1, 9):
            _step(model, b)
    msg, = _messages(record)
    assert "changes from step to step" in msg and "drop_last=True" in msg and "(this one: [4, 3, 32, 32])" in msg
    assert fake.captures == [] and handle.eager_calls == 8 and handle.replays == 0


def test_a_new_recipe_or_keyword_input_on_a_captured_shape_is_said_at_once(fake):
    # Unlike a new batch size, the same shape under another recipe is unusual: one warning at its
    # first sight, and it is captured as well if it repeats.
    model = _vit()
    handle = fp8vit.make_graphed_blocks(model)
    _step(model, 4), _step(model, 4)
    fake.recipe = _Current()
    with pytest.warns(RuntimeWarning, match=r"captured with FP8 recipe 'delayed', the call runs with 'current'.*"
                                            r"captured as well if it repeats"):
        _step(model, 4)
    _step(model, 4)
    assert [s.recipe_name for s in handle.shapes] == ["delayed", "current"]


def test_the_same_recipe_with_other_settings_is_another_signature_not_a_replay(fake):
    # The graphs bake a recipe's settings in (the margin in the scale update, the GEMMs'
    # accumulation): a recipe of the same name with other settings must not replay them.
    model = _vit()
    handle = fp8vit.make_graphed_blocks(model)
    fake.recipe.margin = 0
    _step(model, 4), _step(model, 4)
    other = _Delayed()
    other.margin, other.fp8_gemm_dgrad = 1, "fast"
    fake.recipe = other
    with pytest.warns(RuntimeWarning, match=r"recipe 'delayed' has other settings than the graphs were captured with "
                                            r"\(fp8_gemm_dgrad None -> 'fast', margin 0 -> 1\).*captured as well"):
        _step(model, 4)
    assert handle.replays == 1 and len(fake.captures) == 1  # not replayed: run eagerly, then captured
    _step(model, 4)
    assert len(fake.captures) == 2 and fake.captures[-1]["recipe"] is other
    same = _Delayed()  # equal settings, another object: the graphs serve it
    same.margin, same.fp8_gemm_dgrad = 1, "fast"
    fake.recipe = same
    replays = handle.replays
    _step(model, 4)
    assert handle.replays == replays + 1 and len(fake.captures) == 2


def test_outside_autocast_and_without_fp8_on_an_fp8_gpu_run_eagerly_saying_why(fake, monkeypatch):
    model = _vit()
    handle = fp8vit.make_graphed_blocks(model)
    fake.dtype, fake.recipe = None, None
    with pytest.warns(RuntimeWarning, match="outside torch autocast.*fp8_context"):
        _step(model, 4), _step(model, 4)
    fake.dtype = torch.bfloat16

    class _FP8GPU:
        class fp8:  # noqa: N801 - what gpu_info() returns, as far as graphs reads it
            ok = True

    monkeypatch.setattr(GC, "gpu_info", lambda: _FP8GPU)
    with pytest.warns(RuntimeWarning, match=r"without FP8 \(outside fp8_context.*fp8=False"):
        _step(model, 4), _step(model, 4)
    assert fake.captures == [] and handle.eager_calls == 4
    bf16 = _vit()
    bf16_handle = fp8vit.make_graphed_blocks(bf16, fp8=False)  # graphs without FP8, asked for
    _step(bf16, 4), _step(bf16, 4)
    assert fake.captures[-1]["recipe"] is None and bf16_handle.shapes[0].recipe_name is None


def test_two_forwards_before_one_backward_run_the_second_eagerly(fake):
    # A replay overwrites the graphs' activations and output: the second forward must not replay
    # while the first one's backward has yet to run.
    model = _vit()
    handle = fp8vit.make_graphed_blocks(model)
    _step(model, 4), _step(model, 4)
    first = model(_images(4))
    with pytest.warns(RuntimeWarning, match="previous graph replay is still in use.*Two forwards before one backward"):
        second = model(_images(4))
    assert handle.replays == 2 and handle.eager_reasons["busy"] == 1
    (first.sum() + second.sum()).backward()
    _step(model, 4)  # the backward ran: replays again
    assert handle.replays == 3
    first = model(_images(4))
    del first  # the graph is dropped without backward: nothing can read the replay any more
    _step(model, 4)
    assert handle.replays == 5


def test_a_referenced_block_output_is_not_overwritten(fake):
    model = _vit()
    handle = fp8vit.make_graphed_blocks(model, stem=False)  # called as model.blocks below
    x = torch.randn(4, 5, 64, requires_grad=True)
    for _ in range(2):
        model.blocks(x).sum().backward()
    kept = model.blocks(x).detach()  # no backward will come; the user keeps the blocks' output
    model.blocks(x)
    assert handle.eager_reasons["busy"] == 1
    del kept
    model.blocks(x)
    assert handle.replays == 3


def test_freezing_or_unfreezing_parameters_drops_the_graphs_and_captures_again(fake):
    # A graph computes the gradients of the parameters trainable at capture: an unfrozen one
    # would silently get none. So the graphs are captured again, for the new set.
    model = _vit()
    handle = fp8vit.make_graphed_blocks(model)
    _step(model, 4), _step(model, 4), _step(model, 3), _step(model, 3)
    assert len(handle.shapes) == 2
    model.blocks[0].qkv.weight.requires_grad_(False)
    with pytest.warns(RuntimeWarning, match=r"requires_grad changed on 1 block parameters since the blocks' CUDA "
                                            r"graphs were captured: the graphs are dropped and captured again"):
        _step(model, 4)
    assert fake.shapes == [(4, 3, 32, 32), (3, 3, 32, 32), (4, 3, 32, 32)] and fake.captures[-1]["first"]
    _step(model, 3)  # known to repeat: captured again at once
    assert fake.shapes[-1] == (3, 3, 32, 32) and len(handle.shapes) == 2
    for p in model.blocks.parameters():
        p.requires_grad_(True)
    _step(model, 4)  # (the same warning is not repeated)
    assert len(fake.captures) == 5 and len(handle.shapes) == 1


def test_a_replaced_parameter_or_block_switch_drops_the_graphs(fake):
    model = _vit()
    handle = fp8vit.make_graphed_blocks(model)
    _step(model, 4), _step(model, 4)
    name, p = next(model.blocks[1].named_parameters())
    module, attr = model.blocks[1], name
    while "." in attr:
        head, attr = attr.split(".", 1)
        module = getattr(module, head)
    setattr(module, attr, torch.nn.Parameter(p.detach().clone()))  # load_state_dict(assign=True) does this
    with pytest.warns(RuntimeWarning, match="1 block parameters were replaced or moved"):
        _step(model, 4)
    fp8vit.set_block_fp8(model, "blocks.0", False)
    with pytest.warns(RuntimeWarning, match="fp8_enabled, grad_checkpointing, recompute_mlp, gelu_in_gemm, "
                                            "bias_attention or rope_kernel switch"):
        _step(model, 4)
    assert len(fake.captures) == 3 and len(handle.shapes) == 1


def test_checkpointing_switched_on_after_capture_runs_eagerly_saying_why(fake):
    model = _vit()
    handle = fp8vit.make_graphed_blocks(model)
    _step(model, 4), _step(model, 4)
    fp8vit.set_grad_checkpointing(model)
    with pytest.warns(RuntimeWarning, match="activation checkpointing is on"):
        _step(model, 4)
    assert handle.shapes == [] and handle.eager_reasons["not capturable"] == 1


@pytest.mark.parametrize("switch, other", [("fp8_enabled", False), ("grad_checkpointing", True),
                                            ("recompute_mlp", True), ("gelu_in_gemm", False),
                                            ("bias_attention", "torch"), ("rope_kernel", "triton")])
def test_every_block_switch_read_by_forward_is_watched_after_capture(fake, switch, other):
    # The graphs replay what was captured: flipping any block switch that changes the forward must
    # be seen (the graphs are then captured again), never be silently ignored. Every public switch
    # FP8Block sets or declares is one of them.
    from fp8vit.blocks.base import FP8Block
    model = _vit()
    handle = fp8vit.make_graphed_blocks(model)
    _step(model, 4), _step(model, 4)
    assert other != getattr(model.blocks[1], switch)
    setattr(model.blocks[1], switch, other)
    assert handle._changed(0) is not None and "switch changed" in handle._changed(0)
    watched = set(GC._SWITCH_NAMES)  # the attributes the dispatch reads (GC._SWITCHES)
    declared = {n for n, v in vars(FP8Block).items() if isinstance(v, (bool, str)) and not n.startswith("_")}
    assert switch in watched and declared <= watched, declared - watched


def test_fsdp2_sharded_blocks_run_eagerly_saying_why(fake, monkeypatch):
    model = _vit()
    handle = fp8vit.make_graphed_blocks(model)
    for module in (G, GC):  # as after another framework's fully_shard
        monkeypatch.setattr(module, "is_sharded", lambda t: True)
    with pytest.warns(RuntimeWarning, match="sharded by FSDP2.*static input surface.*FSDP2 runs eagerly"):
        _step(model, 4), _step(model, 4)
    assert fake.captures == [] and handle.eager_calls == 2
    with pytest.raises(ValueError, match="sharded by FSDP2"):
        fp8vit.make_graphed_blocks(_vit())


def test_fsdp1_managed_blocks_run_eagerly_saying_why(fake):
    # Lightning's FSDP strategy (FullyShardedDataParallel) wraps after the plugin installed graphs;
    # FSDP marks the parameters it flattened
    model = _vit()
    handle = fp8vit.make_graphed_blocks(model)
    for p in model.blocks.parameters():
        p._fsdp_flattened = True
    with pytest.warns(RuntimeWarning, match=r"managed by FSDP \(FullyShardedDataParallel.*cuda_graphs=False"):
        _step(model, 4), _step(model, 4)
    assert fake.captures == [] and handle.eager_calls == 2


def test_a_capture_out_of_memory_stops_capturing_says_so_and_keeps_the_graphs_held(fake):
    model = _vit()
    handle = fp8vit.make_graphed_blocks(model)
    _step(model, 4), _step(model, 4)
    fake.oom = True
    _step(model, 8)
    with pytest.warns(RuntimeWarning, match=r"capturing the blocks for \[8, 3, 32, 32\] ran out of GPU memory.*"
                                            r"those held \(\[\[4, 3, 32, 32\]\]\) keep replaying"):
        out = _step(model, 8)
    assert out.shape == (8, 3) and handle.eager_reasons["capture failed"] == 1
    fake.oom = False
    _step(model, 2), _step(model, 2)  # no more captures
    _step(model, 4)
    assert fake.shapes == [(4, 3, 32, 32)] and handle.replays == 2


def test_a_capture_that_raises_inside_a_step_runs_eagerly_saying_why(fake, monkeypatch):
    model = _vit()
    handle = fp8vit.make_graphed_blocks(model)

    def broken(*a):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(G.GraphedBlocks, "_run_capture", broken)
    _step(model, 4)
    with pytest.warns(RuntimeWarning, match=r"capturing the blocks for \[4, 3, 32, 32\] failed \(RuntimeError\): CUDA "
                                            r"error: operation not permitted"):
        out = _step(model, 4)
    assert out.shape == (4, 3) and handle.shapes == [] and handle.eager_reasons["capture failed"] == 1


def test_gradients_aliasing_a_graph_buffer_are_copied_before_a_capture(fake):
    # The warm-up of a new shape's capture rewrites the fused-wgrad buffers that a .grad of the
    # last micro-batch may still be (gradient accumulation).
    model = _vit()
    handle = fp8vit.make_graphed_blocks(model)
    _step(model, 4), _step(model, 4)
    p = handle._params[0]
    static = torch.randn_like(p)
    p.grad = static.detach()
    handle._static_ptrs.add(static.data_ptr())
    _step(model, 3)
    _step(model, 3)  # captured here
    assert p.grad.data_ptr() != static.data_ptr()


def test_positional_inputs_and_cpu_input_run_eagerly(fake, monkeypatch):
    model = _eva()
    handle = fp8vit.make_graphed_blocks(model)
    x = torch.randn(2, 17, 64)
    with pytest.warns(RuntimeWarning, match="positional inputs besides x"):
        model.blocks[0](x, None)
    monkeypatch.setattr(G.GraphedBlocks, "_on_gpu", staticmethod(lambda t: False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.blocks[0](x)
    assert handle.eager_reasons == {"positional inputs": 1, "not on a GPU": 1}


# --------------------------------------------------------------------------- per-block graphs (EVA)
def test_per_block_graphs_capture_what_each_block_got_at_the_first_sight(fake):
    model = _eva()
    handle = fp8vit.make_graphed_blocks(model)
    assert handle.per_block
    _step(model, 2, size=56)
    assert handle.eager_calls == 3 and fake.captures == []  # one per block
    _step(model, 2, size=56)
    cap, = fake.captures
    assert cap["shape"] == (2, 17, 64) and len(cap["dtypes"]) == 3
    assert [set(k) for k in cap["kwargs"]] == [{"rope"}] * 3
    assert handle.replays == 3 and handle.shapes[0].call_kwargs["rope"][0] == (16, 32)
    _step(model, 2, size=56)
    assert handle.replays == 6
    with torch.no_grad():
        model.blocks[1](torch.randn(2, 17, 64), rope=model.rope.get_embed())  # a block called alone: eager
    assert handle.eager_reasons["block called alone"] == 1


def test_per_block_graphs_check_each_block_before_its_own_replay(fake):
    # Each block's parameters are checked just before its replay (the GPU runs the blocks before it
    # meanwhile). A change in a later block: the blocks before it replay, it and the blocks after it
    # run eagerly, and the next forward drops the graphs and captures them again, saying why.
    model = _eva()
    handle = fp8vit.make_graphed_blocks(model)
    _step(model, 2, size=56), _step(model, 2, size=56)
    assert handle.replays == 3 and len(fake.captures) == 1
    w = model.blocks[2].mlp.fc2.weight
    w.data = w.data.clone()  # the same Parameter on other storage (what Module._apply does)
    _step(model, 2, size=56)
    assert handle.replays == 3 + 2 and handle.eager_reasons["parameters changed"] == 1
    with pytest.warns(RuntimeWarning, match=r"1 block parameters \(block 2\) were replaced or moved since the "
                                            r"blocks' CUDA graphs were captured"):
        _step(model, 2, size=56)
    assert len(fake.captures) == 2 and handle.replays == 5 + 3  # the known shape is captured again at once
    model.blocks[1].proj.bias.requires_grad_(False)
    _step(model, 2, size=56)
    assert handle.replays == 8 + 1 and handle.eager_reasons["parameters changed"] == 1 + 2  # blocks 1 and 2
    with pytest.warns(RuntimeWarning, match=r"requires_grad changed on 1 block parameters \(block 1\)"):
        _step(model, 2, size=56)
    assert len(fake.captures) == 3 and handle.replays == 9 + 3


def test_per_block_graphs_say_when_a_keyword_input_differs_from_the_capture(fake):
    model = _eva()
    fp8vit.make_graphed_blocks(model)
    _step(model, 2, size=56), _step(model, 2, size=56)
    rope = model.rope.get_embed().to(torch.bfloat16)  # the capture saw fp32
    with pytest.warns(RuntimeWarning, match=r"rope is \[16, 32\] torch.bfloat16, the graphs were captured for "
                                            r"\[16, 32\] torch.float32"):
        model.blocks[0](torch.randn(2, 17, 64), rope=rope)


# --------------------------------------------------------------------------- conversion, copies, release
def test_convert_to_te_cuda_graphs_sets_up_graphs_an_unchanged_loop_uses(fake):
    model = _vit(cuda_graphs=True)
    assert G.graphed_modules(model) == [""]  # the ViT's forward_features: its stem is in the graphs
    handle = G.GraphedBlocks.of(model)
    assert handle.max_shapes == G.MAX_SHAPES and handle.shapes == [] and handle.fused_wgrad
    for _ in range(3):
        _step(model, 4)
    assert fake.shapes == [(4, 3, 32, 32)] and handle.replays == 2
    fp8vit.convert_from_te(model)  # back to timm: the graphs go too
    assert G.graphed_modules(model) == [] and G.GraphedBlocks.of(model) is None


def test_convert_to_te_cuda_graphs_without_blocks_warns_and_installs_nothing():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.warns(UserWarning, match=r"cuda_graphs=True\): .*no nn.Sequential or nn.ModuleList 'blocks'"):
        fp8vit.convert_to_te(model, backend="reference", cuda_graphs=True)
    assert G.graphed_modules(model) == []


def test_on_the_cpu_the_graphs_set_up_at_conversion_stay_out_of_the_way():
    model, plain = _vit(cuda_graphs=True), _vit()
    x = _images(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)
    assert G.GraphedBlocks.of(model).eager_reasons == {"not on a GPU": 2}


def test_make_graphed_blocks_replaces_graphs_set_up_but_never_captured(fake):
    model = _vit(cuda_graphs=True)
    old = G.GraphedBlocks.of(model)
    handle = fp8vit.make_graphed_blocks(model, max_shapes=1)
    assert G.GraphedBlocks.of(model) is handle is not old and handle.max_shapes == 1
    _step(model, 4), _step(model, 4)
    with pytest.raises(ValueError, match="already graphed.*release"):
        fp8vit.make_graphed_blocks(model)
    handle.release()
    assert G.graphed_modules(model) == [] and "forward" not in vars(model.blocks)
    fp8vit.make_graphed_blocks(model)


def test_release_and_clear(fake):
    model = _vit()
    handle = fp8vit.make_graphed_blocks(model)
    _step(model, 4), _step(model, 4)
    handle.clear()
    assert handle.shapes == [] and handle.memory_bytes == 0
    _step(model, 4)  # a new first sight
    assert len(fake.captures) == 1
    _step(model, 4)
    assert len(fake.captures) == 2
    handle.release()
    _step(model, 4), _step(model, 4)
    assert len(fake.captures) == 2 and G.graphed_modules(model) == []


@pytest.mark.parametrize("make", [_vit, _eva], ids=["vit", "eva-per-block"])
def test_a_copy_carries_the_settings_not_the_graphs(fake, make):
    # EMA (timm's ModelEmaV3 deep-copies the model), torch.save(model): the copy's own graphs.
    model = make()
    handle = fp8vit.make_graphed_blocks(model, max_shapes=2)
    size = 56 if handle.per_block else 32
    _step(model, 2, size), _step(model, 2, size)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        twin_handle = G.GraphedBlocks.of(twin)
        assert twin_handle is not handle and twin_handle.shapes == [] and twin_handle.max_shapes == 2
        assert all(vars(obj)[attr].handle is twin_handle for obj, attr in twin_handle._seats())
        assert all(t1 is not t0 for t1, t0 in zip(twin_handle._targets, handle._targets))
        _step(twin, 2, size), _step(twin, 2, size)
        assert len(twin_handle.shapes) == 1
    assert len(handle.shapes) == 1


# --------------------------------------------------------------------------- the stem in the graphs
def test_the_stem_in_the_graphs_captures_from_the_images_on_forward_features(fake):
    model, plain = _vit(), _vit()
    handle = fp8vit.make_graphed_blocks(model, stem=True)
    assert G.graphed_modules(model) == [""] and G.GraphedBlocks.of(model) is handle and handle.stem
    assert "forward" not in vars(model.blocks) and "stem, blocks and norm" in handle.describe()
    x = _images(4)
    for _ in range(3):
        out, ref = model(x), plain(x)
        out.float().sum().backward(), ref.float().sum().backward()
    # captured at the second sight, keyed on the images, which need no gradient
    assert fake.shapes == [(4, 3, 32, 32)] and fake.captures[0]["requires_grad"] is False
    assert handle.replays == 2 and handle.eager_reasons == {"new shape": 1}
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):  # the stem's gradients too
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    model.eval()
    with torch.no_grad():
        model(x)
    assert handle.eager_reasons["eval"] == 1  # the ViT's mode, not the graphed module's
    handle.release()
    assert G.graphed_modules(model) == [] and "forward_features" not in vars(model)


def test_stem_true_where_the_stem_cannot_join_says_why():
    with pytest.raises(ValueError, match=r"stem=True.*Eva.forward_features is not timm VisionTransformer's own"):
        fp8vit.make_graphed_blocks(_eva(), stem=True)
    with pytest.raises(ValueError, match=r"tokens=9 .*stem=True"):
        fp8vit.make_graphed_blocks(_vit(), tokens=9, stem=True)
    model = _vit()
    model.patch_embed.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match=r"model.patch_embed has module hooks"):
        fp8vit.make_graphed_blocks(model, stem=True)
    with pytest.raises(TypeError, match="stem"):
        fp8vit.make_graphed_blocks(_vit(), stem="yes")
    assert not fp8vit.make_graphed_blocks(model, stem=False).stem


def test_the_stem_graphs_run_eagerly_saying_why_when_they_cannot_replay(fake):
    model = _vit()
    handle = fp8vit.make_graphed_blocks(model, stem=True)
    _step(model, 4), _step(model, 4)
    with pytest.warns(RuntimeWarning, match="images require grad"):
        model(_images(4).requires_grad_()).sum().backward()
    # a hook on the stem after capture: the graphs go, and are not captured again (a replay would
    # not run the hook)
    model.norm.register_forward_hook(lambda *a: None)
    with pytest.warns(RuntimeWarning) as record:
        _step(model, 4), _step(model, 4)
    said = _messages(record)
    assert len(said) == 2 and "stem or final norm" in said[0] and "model.norm has module hooks" in said[1]
    assert handle.shapes == [] and handle.eager_reasons["not capturable"] == 2
    model = _vit()
    handle = fp8vit.make_graphed_blocks(model, stem=True)
    _step(model, 4), _step(model, 4)
    model.set_grad_checkpointing(True)  # timm's own switch, on the ViT
    with pytest.warns(RuntimeWarning, match="activation checkpointing is on"):
        _step(model, 4), _step(model, 4)
    assert handle.shapes == [] and handle.eager_reasons["not capturable"] == 2


@pytest.mark.parametrize("how", ["make_graphed_blocks", "convert_to_te"])
def test_a_stem_joined_by_default_leaves_the_graphs_for_a_hook_and_the_blocks_stay_graphed(fake, how):
    # stem=None: the stem joined because it could; a hook added later on the final norm (features for
    # a distillation loss) must run every step, and the blocks keep their graphs rather than the
    # whole model running eagerly (with stem=True: eagerly, the test above)
    model = _vit(cuda_graphs=True) if how == "convert_to_te" else _vit()
    handle = G.GraphedBlocks.of(model) if how == "convert_to_te" else fp8vit.make_graphed_blocks(model)
    assert handle.stem
    _step(model, 4), _step(model, 4)
    assert fake.shapes == [(4, 3, 32, 32)] and handle.replays == 1
    twin = G.GraphedBlocks.of(pickle.loads(pickle.dumps(model)))
    seen = []
    model.norm.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    with pytest.warns(RuntimeWarning) as record:
        _step(model, 4)
    said = _messages(record)
    assert "stem or final norm" in said[0] and "model.norm has module hooks" in said[-1] and "blocks alone" in said[-1]
    assert not handle.stem and G.graphed_modules(model) == ["blocks"] and G.GraphedBlocks.of(model) is handle
    assert "forward_features" not in vars(model) and handle.shapes == []
    _step(model, 4), _step(model, 4)  # the blocks' tokens: noted at the call above, captured now
    assert fake.shapes == [(4, 3, 32, 32), (4, 5, 64)] and handle.replays == 3 and len(seen) == 3
    assert "model.blocks: 1 of at most" in handle.describe()
    # a copy made while the stem was in the graphs carries the default: it leaves them too
    twin_model = twin._vit
    twin_model.norm.register_forward_hook(lambda *a: None)
    _step(twin_model, 4)  # (the same warning: said once per process)
    assert not twin.stem and G.graphed_modules(twin_model) == ["blocks"] and twin.eager_reasons["stem left the graphs"] == 1


def test_a_replaced_final_norm_is_captured_anew(fake):
    model = _vit()
    handle = fp8vit.make_graphed_blocks(model, stem=True)
    _step(model, 4), _step(model, 4)
    model.norm = torch.nn.LayerNorm(64, elementwise_affine=False)
    with pytest.warns(RuntimeWarning, match="stem or final norm was replaced"):
        _step(model, 4)  # a signature seen before: captured again at once, with the new norm
    assert len(fake.captures) == 2 and handle._targets[0].norm is model.norm and handle.replays == 2
    x = _images(4)
    torch.testing.assert_close(model.forward_features(x), type(model).forward_features(model, x), rtol=0, atol=0)


def test_a_replaced_position_embedding_is_used_at_once_and_captured_anew(fake):
    # set_input_size / resampling assigns a new nn.Parameter: an eager call (eval) uses it at once,
    # and training drops the graphs that hold the old one
    model = _vit()
    handle = fp8vit.make_graphed_blocks(model, stem=True)
    _step(model, 4), _step(model, 4)
    model.pos_embed = torch.nn.Parameter(model.pos_embed.detach() + 1)
    x = _images(4)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model.forward_features(x), type(model).forward_features(model, x), rtol=0, atol=0)
    model.train()
    with pytest.warns(RuntimeWarning, match="block parameters were replaced or moved"):
        _step(model, 4)
    assert len(fake.captures) == 2 and handle._targets[0].pos_embed is model.pos_embed
    _step(model, 4)
    assert model.pos_embed.grad is not None


def test_a_copy_of_a_stem_graphed_model_graphs_its_own_stem(fake):
    model = _vit()
    handle = fp8vit.make_graphed_blocks(model, stem=True, max_shapes=2)
    _step(model, 2), _step(model, 2)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        twin_handle = G.GraphedBlocks.of(twin)
        assert twin_handle is not handle and twin_handle.stem and twin_handle._vit is twin
        assert twin_handle.shapes == [] and twin_handle.max_shapes == 2
        _step(twin, 2), _step(twin, 2)
        assert len(twin_handle.shapes) == 1 and twin_handle._targets[0].blocks is twin.blocks
    assert len(handle.shapes) == 1


# --------------------------------------------------------------------------- gradients out of the graphs
def test_only_gradients_aliasing_the_graph_buffers_are_copied_before_a_replay():
    # The logic that keeps accumulation right when gradients leave the graphs uncopied (the GPU
    # tests check it end to end): a .grad that is a view of a graph buffer is replaced by a copy
    # with the same values; a .grad elsewhere (e.g. a DDP bucket view) and a None stay as they are.
    static = torch.randn(6)                      # stands in for the backward graph's buffer
    aliased, own, none = (torch.nn.Parameter(torch.zeros(6)) for _ in range(3))
    aliased.grad = static.detach()
    own.grad = torch.randn(6)
    own_grad = own.grad
    handle = G.GraphedBlocks(torch.nn.Sequential(torch.nn.Identity()), False)
    handle._params = (aliased, own, none)
    entry = G.GraphShape((6,), (torch.float32,), torch.bfloat16, None, {}, _recorded=[False])
    GC._AfterBackward(handle, entry, 0)((static.detach(), None), ())
    assert entry._recorded == [True]
    handle._copy_aliased_grads()
    assert aliased.grad.data_ptr() != static.data_ptr() and torch.equal(aliased.grad, static)
    static.add_(1.0)                             # the next replay rewrites the buffer
    assert not torch.equal(aliased.grad, static)
    assert own.grad is own_grad and none.grad is None


class _FakeTELinear(torch.nn.Module):
    """What fp8vit._te.wgrad_into_main_grad reads of a TE GEMM module: its switch and weights."""

    def __init__(self, names=("weight",), list_names=True):
        super().__init__()
        self.fuse_wgrad_accumulation = False
        if list_names:
            self.weight_names = list(names)
        for n in names:
            self.register_parameter(n, torch.nn.Parameter(torch.randn(3, 2)))


def test_wgrad_into_main_grad_gives_trainable_te_gemm_weights_a_buffer_and_restores_the_switch():
    from fp8vit import _te
    linear, mlp, frozen = _FakeTELinear(), _FakeTELinear(("fc1_weight", "fc2_weight"), list_names=False), _FakeTELinear()
    frozen.weight.requires_grad_(False)
    # TE concatenates split weights (te.TransformerLayer's QKV) into a new tensor: no main_grad there
    split = _FakeTELinear(("query_weight", "key_weight", "value_weight"))
    model = torch.nn.Sequential(linear, mlp, frozen, split, torch.nn.Linear(2, 2))  # nn.Linear: not TE's
    with _te.wgrad_into_main_grad([model]) as weights:
        assert [id(w) for w in weights] == [id(linear.weight), id(mlp.fc1_weight), id(mlp.fc2_weight)]
        assert linear.fuse_wgrad_accumulation and mlp.fuse_wgrad_accumulation
        assert not frozen.fuse_wgrad_accumulation and not hasattr(frozen.weight, "main_grad")
        assert not split.fuse_wgrad_accumulation and not hasattr(split.query_weight, "main_grad")
        for w in weights:
            assert w.main_grad.shape == w.shape and w.main_grad.dtype == w.dtype and w.overwrite_main_grad
    # Off again for eager calls; the buffers stay for the graphs captured inside.
    assert not linear.fuse_wgrad_accumulation and not mlp.fuse_wgrad_accumulation
    assert all(hasattr(w, "main_grad") for w in weights)
    # A later capture (another shape) reuses them: the graphs already captured write into them.
    buffers = [w.main_grad for w in weights]
    with _te.wgrad_into_main_grad([model], reuse=True) as again:
        assert [w.main_grad for w in again] == buffers and all(a is b for a, b in zip((w.main_grad for w in again),
                                                                                      buffers))
    with _te.wgrad_into_main_grad([model]):
        assert all(w.main_grad is not b for w, b in zip(weights, buffers))
    _te.release_main_grad(weights)
    assert not any(hasattr(w, a) for w in weights for a in ("main_grad", "overwrite_main_grad"))


def test_main_grads_reach_autograd_uncopied_and_are_copied_before_the_next_replay():
    # The node before the graphed blocks hands each fused weight its main_grad: p.grad becomes a
    # view of it (no copy), accumulation adds to it, and before the next replay (which rewrites
    # main_grad) a p.grad still aliasing it is copied.
    from fp8vit.training.graph_cache import _MainGradsToAutograd
    w = torch.nn.Parameter(torch.zeros(4))
    w.main_grad = torch.randn(4)                 # what the backward graph wrote
    x = torch.randn(4, requires_grad=True)
    _MainGradsToAutograd.apply(x, (w.main_grad,), w).sum().backward()
    assert torch.equal(x.grad, torch.ones(4))
    assert w.grad.data_ptr() == w.main_grad.data_ptr()
    handle = G.GraphedBlocks(torch.nn.Sequential(torch.nn.Identity()), False)
    handle._params, handle._static_ptrs = (w,), {w.main_grad.data_ptr()}
    handle._copy_aliased_grads()
    first = w.grad
    assert first.data_ptr() != w.main_grad.data_ptr() and torch.equal(first, w.main_grad)
    w.main_grad.mul_(-1.0)                       # the next backward graph's gradient
    _MainGradsToAutograd.apply(x, (w.main_grad,), w).sum().backward()
    assert torch.allclose(w.grad, torch.zeros(4))  # accumulated: g + (-g)


def test_a_failed_capture_restores_tes_process_wide_state(monkeypatch):
    # TE wraps the graphed module's class __call__ in its autocast and sets a "capturing" flag that
    # stops every amax reduction; its own clean-up does not run when the capture raises.
    import types
    from fp8vit._te import graphs as seam
    flag = {"capturing": False}
    graph_mod = types.SimpleNamespace(set_capture_end=lambda: flag.update(capturing=False))

    def make_graphed_callables(modules, sample_args, **kw):
        flag["capturing"] = True
        type(modules).__call__ = lambda self, *a, **k: "wrapped"
        import gc
        gc.disable()
        raise RuntimeError("capture failed")

    monkeypatch.setattr(seam, "load_te", lambda: types.SimpleNamespace(make_graphed_callables=make_graphed_callables))
    monkeypatch.setattr(seam, "te_module", lambda name: graph_mod)

    class Blocks(torch.nn.Sequential):
        pass

    blocks = Blocks(torch.nn.Identity())
    with pytest.raises(RuntimeError, match="capture failed"):
        seam.make_graphed_callables((blocks,), ((torch.zeros(1),),), fp8=False, recipe=None, num_warmup_iters=1)
    import gc
    assert "__call__" not in Blocks.__dict__ and not flag["capturing"] and gc.isenabled()
    assert torch.equal(blocks(torch.ones(1)), torch.ones(1))


def test_capture_sees_fresh_parameter_leaves_and_replays_hand_gradients_to_the_real_ones():
    # TE's capture backward cannot reach a gradient accumulator made on the default stream (the
    # previous step's loss keeps the parameters' alive): it captures with fresh leaves sharing the
    # parameters' storage and attributes, and its graphed forward is pointed back at the real ones.
    from fp8vit._te import graphs as seam

    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    m[0].weight.main_grad = torch.zeros(2, 2)
    real = list(m.parameters())

    def te_like_install(module):  # the shape of TE's installed forward: new_fwd -> functionalized
        module_params = tuple(module.parameters())

        def functionalized(*args):
            return module_params

        def new_fwd(*args):
            return functionalized(*args)

        module.forward = new_fwd

    with seam._fresh_leaves((m,)) as originals:
        seen = list(m.parameters())
        assert all(a is not b and a.data_ptr() == b.data_ptr() for a, b in zip(seen, real))
        assert seen[0].main_grad is real[0].main_grad
        te_like_install(m)
        seam._rebind_params(m, originals)
    assert all(a is b for a, b in zip(m.parameters(), real))
    assert all(a is b for a, b in zip(m.forward(), real))
    bare = torch.nn.Linear(2, 2)
    bare.forward = lambda *a: None  # no module_params anywhere: a TE whose layout fp8vit does not know
    with pytest.raises(RuntimeError, match="module_params"):
        seam._rebind_params(bare, {})


def test_the_conversion_summary_says_what_the_graphs_did():
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=2)
    plain = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp8vit.convert_to_te(model, cuda_graphs=True)
        fp8vit.convert_to_te(plain)
    summary = fp8vit.conversion_summary(model)
    assert summary.cuda_graphs == ("stem, blocks and norm: 0 of at most 3 batch shapes captured, 0 replays, "
                                   "0 eager calls, 0 MiB")
    assert "; CUDA-graphed blocks" in summary.short() and f"  CUDA graphs: {summary.cuda_graphs}" in summary.table()
    assert summary.to_dict()["cuda_graphs"] == summary.cuda_graphs
    with fp8vit.fp8_context():
        model(torch.randn(2, 3, 32, 32))  # on the CPU: eager, counted by reason
    assert "1 eager calls (not on a GPU 1)" in fp8vit.conversion_summary(model).cuda_graphs
    none = fp8vit.conversion_summary(plain)
    assert none.cuda_graphs is None and "CUDA" not in none.short() and "CUDA graphs" not in none.table()


def test_cuda_graphs_on_a_wrapper_graph_the_vits_inside_and_nothing_else():
    # A LightningModule (self.model), a CLIP-like model: no blocks of its own. The ViT inside gets
    # the graphs; a ConvNeXt stage's `blocks` (no fp8vit block in it) is left alone.
    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=2)
    cnn = timm.create_model("convnext_atto", num_classes=2)
    wrapper = nn.ModuleDict({"vit": vit, "cnn": cnn})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fp8vit.convert_to_te(wrapper, backend="reference", exact_gelu=True, cuda_graphs=True)
    assert not [w for w in seen if "not graphed" in str(w.message) or "cuda_graphs=True:" in str(w.message)]
    assert fp8vit.GraphedBlocks.of(vit) is not None
    assert all(fp8vit.GraphedBlocks.of(stage) is None for stage in cnn.stages)
    assert "CUDA-graphed" in fp8vit.conversion_summary(wrapper).short()
    fp8vit.convert_from_te(wrapper)
    assert fp8vit.GraphedBlocks.of(vit) is None


def test_cuda_graphs_on_a_module_with_no_vit_inside_says_why():
    cnn = timm.create_model("convnext_atto", num_classes=2)
    with pytest.warns(UserWarning, match=r"cuda_graphs=True\): .*has no nn.Sequential or nn.ModuleList 'blocks'"):
        fp8vit.convert_to_te(cnn, backend="reference", cuda_graphs=True)


def test_blocks_called_with_a_list_run_eagerly_and_say_why():
    # A model whose blocks take a list (no branches of fp8vit blocks inside to graph instead): the
    # graphs (one tensor in) cannot take it; the blocks run eagerly, as without graphs, and say so.
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = (fp8vit.TE_Block(dim=32, num_heads=2, backend="reference") for _ in range(2))

        def forward(self, xs):
            return [self.a(xs[0]), self.b(xs[1])]

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Pair(), Pair()])

        def forward(self, xs):
            for blk in self.blocks:
                xs = blk(xs)
            return xs

    torch.manual_seed(0)
    ref = Model().train()
    model = copy.deepcopy(ref)
    assert G.install_graphs(model) is None and G.graphed_modules(model) == ["blocks.0", "blocks.1"]
    xs = [torch.randn(2, 5, 32), torch.randn(2, 3, 32)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = ref(xs), model(xs)
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert any("called with a list, not one tensor" in str(w.message) for w in caught), [str(w.message) for w in caught]


def test_crossvit_graphs_each_branch_not_the_blocks_called_with_a_list():
    # CrossViT's model.blocks are MultiScaleBlocks called with a list of two branches' tokens: no
    # graph takes a list. Each branch, an nn.Sequential of fp8vit blocks called with one tensor
    # [B, N_i, C_i], is graphed on its own; the MultiScaleBlocks are not touched. On the CPU the
    # dispatch runs the blocks eagerly: the same output as without graphs.
    name = "crossvit_tiny_240"
    torch.manual_seed(0)
    ref = fp8vit.convert_to_te(timm.create_model(name, num_classes=3), backend="reference")
    model = copy.deepcopy(ref)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fp8vit.convert_to_te(model, backend="reference", cuda_graphs=True)
        x = torch.randn(2, 3, 240, 240)
        outs = [m.train()(x) for m in (ref, model)]
        outs[1].sum().backward()
    assert torch.equal(outs[0], outs[1])
    messages = [str(w.message) for w in caught]
    assert not any("called with a list" in m or "not graphed" in m for m in messages), messages
    branches = [f"blocks.{i}.blocks.{j}" for i in range(len(model.blocks)) for j in range(2)]
    assert sorted(G.graphed_modules(model)) == branches
    handles = G.graphed_handles(model)
    assert len(handles) == len(branches) and all(not h.per_block for h in handles)
    with pytest.raises(ValueError, match="graphs each branch"):
        fp8vit.make_graphed_blocks(copy.deepcopy(ref))
    fp8vit.convert_from_te(model)
    assert G.graphed_modules(model) == []


def test_cudnn_layernorm_by_default_only_where_it_was_measured_faster(monkeypatch):
    # levers 8 and 32: cuDNN's LayerNorm in the graphs at widths TE has no tuned kernel for (ViT-H's
    # 1280, Swin's and ConvNeXt's 128-512) under delayed scaling; not at tuned widths (768, 1024, 1536:
    # ViT-B/L unchanged), not for RMSNorm blocks (not measured), not under current scaling (TE's fused
    # norm + amax kernel), not without TE's switch, and never against an explicit choice.
    from types import SimpleNamespace

    def blocks(*widths, norm="LayerNorm"):
        return [SimpleNamespace(cfg=SimpleNamespace(dim=w, norm=norm)) for w in widths]

    def recipe(kind):  # a TE recipe object as recipe_name reads it (TE is not needed here)
        return SimpleNamespace(delayed=lambda: kind == "delayed",
                               float8_current_scaling=lambda: kind == "current")

    monkeypatch.setattr(GC._te, "cudnn_norm_available", lambda: True)
    assert all(GC.cudnn_norm_pays(blocks(*w)) for w in ((1280, 1280), (1408,), (128, 128), (256,), (512,), (1664,)))
    assert not any(GC.cudnn_norm_pays(blocks(*w)) for w in ((768,), (1024,), (1536,), (3072,), (1280, 1024), ()))
    assert not GC.cudnn_norm_pays(blocks(1280, norm="RMSNorm"))
    monkeypatch.setattr(GC._te, "cudnn_norm_available", lambda: False)
    assert not GC.cudnn_norm_pays(blocks(1280))
    monkeypatch.setattr(GC._te, "cudnn_norm_available", lambda: True)
    handle = GC.GraphedBlocks(nn.Sequential(), False)
    handle._fp8_blocks = blocks(1280, 1280)
    delayed, current = recipe("delayed"), recipe("current")
    assert handle._cudnn_norm_for(delayed) and not handle._cudnn_norm_for(current)
    assert not handle._cudnn_norm_for(None)  # FP8 off
    handle.cudnn_layernorm = False
    assert not handle._cudnn_norm_for(delayed)
    handle.cudnn_layernorm, handle._fp8_blocks = True, blocks(768)
    assert handle._cudnn_norm_for(current)
    monkeypatch.setattr(GC._te, "cudnn_norm_available", lambda: False)
    handle.cudnn_layernorm, handle._fp8_blocks = None, blocks(1280)
    assert not handle._cudnn_norm_for(delayed)
