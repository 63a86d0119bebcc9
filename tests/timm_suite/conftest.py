"""timm's own model tests (vendored ``test_models.py``) run on models converted by fp8vit.

Every model that ``timm.create_model`` builds inside this folder's tests goes through
``fp8vit.convert_to_te(model, backend="reference")`` (fp8vit's PyTorch modules with TE's parameter
names: timm's tests build models on the CPU and the meta device, where TE does not run) if it
contains a block of one of fp8vit's families (``fp8vit.families``: ``vision_transformer.Block``,
``eva.EvaBlock``, ``eva.EvaBlockPostNorm``); a model without one is returned unchanged. A block
that fp8vit refuses (``ConversionError``) fails the test that built it: nothing is skipped silently.

Environment:
    FP8VIT_TIMM_NO_CONVERT=1  do not convert (baseline: timm's tests on timm's own models).
    FP8VIT_TIMM_MODELS=g1,g2  instead of the CI subset: every test parametrized by a model name
                              matching one of these fnmatch globs (e.g. 'deit*,pit_*'), with no
                              time limit on timm's slow tests.
    FP8VIT_TIMM_FULL=1        every test of the vendored file (about 15,000; many hours on CPU).
    FP8VIT_TIMM_NETWORK=1     keep the tests that download pretrained weights from the Hugging Face
                              hub (deselected otherwise: CI has no route to it).

CI subset (the default, part of ``python -m pytest tests``): the tests parametrized by a model
name in ``CI_MODELS`` (small models, each converted family at least once, plus models without
timm Blocks that must pass through unchanged), except timm's slow pruning test, which runs on
``CI_SLOW_MODELS`` only, and the model-specific tests in ``CI_EXTRA_TESTS``. Everything else is
deselected (reported as deselected, never as passed or skipped). 299 tests; the EVA, RoPE ViT,
PE and ViTamin models (EVA models converted since issue 32) take about 30 s of it on 2 idle CPU
cores.

Known failures of converted models are ``xfail(strict=True)``, all listed in ``XFAIL`` below.

If the installed timm is not ``TIMM_VERSION``, the vendored file is not collected (a warning says so).
"""

from __future__ import annotations

import fnmatch
import functools
import os
import pathlib

import pytest

TIMM_VERSION = "1.0.31"  # the timm release test_models.py was vendored from
HERE = pathlib.Path(__file__).parent

NO_CONVERT = os.environ.get("FP8VIT_TIMM_NO_CONVERT") == "1"
FULL = os.environ.get("FP8VIT_TIMM_FULL") == "1"
NETWORK = os.environ.get("FP8VIT_TIMM_NETWORK") == "1"
MODEL_GLOBS = [g.strip() for g in os.environ.get("FP8VIT_TIMM_MODELS", "").split(",") if g.strip()]

# Small models, each family whose models contain timm vision_transformer.Block at least once
# (found by building every timm 1.0.31 model on the meta device: 234 models, in
# vision_transformer (incl. hybrid, CLIP, DINOv2, register/GAP, DeiT-III), deit, pit, crossvit,
# byobnet's MobileViT, vitamin and naflexvit; naflexvit is covered by CI_EXTRA_TESTS, its registered
# models being 86M parameters and up), and the smallest of each kind of eva.Eva model (EvaBlock:
# EVA02, fixed and mixed RoPE ViT, Perception Encoder; the RoPE angle cache of fp8vit/eva.py once
# crashed test_model_forward_fx's inference mode on mixed RoPE only), and BEiT's smallest.
CONVERTED_MODELS = [
    "test_vit",                          # VisionTransformer, class token       (0.4M params)
    "test_vit2",                         # no class token, 1 register, avg pool, LayerScale
    "test_vit3",                         # MAP attention pooling, LayerScale
    "test_vit4",                         # RMSNorm blocks, LayerScale
    "vit_tiny_patch16_224",              # classic ViT                          (5.7M)
    "vit_xsmall_patch16_clip_224",       # CLIP-style pre-norm, eps 1e-5        (8.3M)
    "vit_tiny_r_s16_p8_224",             # hybrid ResNet stem + ViT             (6.3M)
    "deit_tiny_distilled_patch16_224",   # deit.VisionTransformerDistilled      (5.9M)
    "deit3_small_patch16_224",           # DeiT-III, LayerScale                 (22M)
    "vit_little_patch16_reg4_gap_256",   # no class token, 4 registers, avg pool (22.5M)
    "pit_ti_224",                        # pit.PoolingVisionTransformer         (4.9M)
    "crossvit_tiny_240",                 # crossvit.CrossVit                    (7M)
    "mobilevit_xxs",                     # byobnet MobileViT (Block inside MobileVitBlock) (1.3M)
    "vitamin_small_224",                 # ViTamin: MbConv stem + Blocks with GeGLU MLP (22M)
    "eva02_tiny_patch14_224",            # eva.Eva: EvaBlock -> TE_EvaBlock, RoPE, SwiGLU (5.5M)
    "vit_small_patch16_rope_224",        # eva.Eva RoPE ViT: fixed RoPE, AttentionRope, LayerScale (22M)
    "vit_small_patch16_rope_mixed_224",  # mixed RoPE: learnable per-head table, timm's RoPE path (22M)
    "vit_pe_core_tiny_patch16_384",      # Perception Encoder, attention pooling (6.1M; fixed 384 px:
                                         # timm skips its FX/backward tests above 256 px, forward runs)
    "beit_base_patch16_224",             # beit.Beit: Block -> TE_BeitBlock, relative position bias
                                         # tables, set_input_size, checkpoint_filter_fn (86M, the
                                         # smallest BEiT: about 1 min here)
    "swin_tiny_patch4_window7_224",      # swin_transformer: SwinTransformerBlock -> TE_SwinBlock,
                                         # shifted windows, padding, set_input_size (28M)
    "swinv2_tiny_window8_256",           # swin_transformer_v2: -> TE_SwinV2Block, cosine attention,
                                         # the bias MLP, post-norm (28M)
    "test_convnext",                     # convnext: ConvNeXtBlock (Linear MLP) -> TE_ConvNeXtBlock
]
# Models without a timm Block: convert_to_te must leave them alone.
PASSTHROUGH_MODELS = [
    "test_resnet",
    "test_vit_relpos",  # a ViT whose blocks are not vision_transformer.Block
]
CI_MODELS = CONVERTED_MODELS + PASSTHROUGH_MODELS

# timm's own CI leaves test_prune_intermediate_layers_contract out ("slow"): 10-110 s a model
# here. The CI subset runs it on these only (about 40 s in all).
SLOW_TESTS = ["test_prune_intermediate_layers_contract"]
CI_SLOW_MODELS = ["test_vit", "test_vit2", "test_vit3", "test_vit4", "deit3_small_patch16_224",
                  "crossvit_tiny_240", "test_resnet"]

# Tests of the vendored file not parametrized by model_name alone that build a converted model
# (NaFlexViT, hybrid ViT, RADIO checkpoint remapping) and are cheap: in the CI subset too.
CI_EXTRA_TESTS = [
    "test_naflexvit_forward_intermediates_dict_input",
    "test_naflexvit_mixed_rope_dict_input",
    "test_naflexvit_patch_interpolation_capability",
    "test_naflexvit_key_only_attn_mask_is_opt_in_and_post_patch_dropout",
    "test_naflexvit_key_only_attn_mask_output_parity",
    "test_naflexvit_sapiens2_conversion",
    "test_hybrid_vit_set_input_size_dtype",
    "test_radio_checkpoint_filter",
]

# Tests that need the Hugging Face hub (pretrained weights, reference tensors).
NETWORK_TESTS = ["test_model_inference", "test_model_load_pretrained", "test_model_features_pretrained"]

# Known failures of converted models, all in one place: (test function glob, model globs, reason).
# A test is marked xfail(strict=True) when, while it runs, create_model() builds a model that has
# timm Blocks (about to be converted) whose name matches the globs ("!glob" excludes). So a model
# that passes through unconverted is never xfailed, and a fix in fp8vit turns the entry into an
# XPASS(strict) failure: then delete the entry.
# TorchScript: torch.jit.script cannot compile fp8vit's modules. Reference backend: in
#   fp8vit/reference.py, DotProductAttention.forward compares an unannotated argument that
#   TorchScript types as Tensor with a str (`mask_type == "causal"`) and _NormParams._ln passes a
#   possibly-None bias to an unannotated parameter; once one compile fails, later ones in the same
#   process fail with "Can't redefine method: forward on class fp8vit.blocks.reference.DotProductAttention".
#   TE backend: TE's modules are not scriptable either.
_SCRIPT = "TorchScript cannot compile fp8vit's modules (fp8vit/reference.py; TE modules neither)"
# state_dict layout: a converted model's block keys are TE_Block's (qkv.layer_norm_weight,
#   mlp.fc1_weight, ...), not timm's. The test writes a checkpoint from a converted model and loads it
#   with create_model(pretrained=True), which loads before the conversion. By design:
#   fp8vit.convert_from_te / fp8vit.blocks.weights.te_to_timm give timm's keys back.
_KEYS = "checkpoint written from a converted model has TE_Block keys; timm loads it before conversion"
# torch.compile(fullgraph=True): fp8vit's blocks run outside dynamo by design (a graph break at each,
#   TE's kernels or CUDA graphs between the compiled parts); without fullgraph the model compiles.
_FULLGRAPH = "fp8vit's blocks run outside dynamo (torch.compiler.disable): no fullgraph=True"
# torch.jit.trace records one forward: TE_SwinBlock moves tokens with index plans made per map size
#   (Python-level, cached), so a trace at one size cannot run at another (timm's block computes its
#   dynamic mask from traced shapes).
_TRACE = "TE_SwinBlock's (and V2's) window plans are per map size: a torch.jit.trace holds the traced size's"
XFAIL: list = [
    ("test_model_forward_torchscript", ("*",), _SCRIPT),
    ("test_model_forward_fx_torchscript", ("*",), _SCRIPT),
    ("test_radio_checkpoint_filter", ("*radio*",), _KEYS),
    ("test_swin_family_script_after_resize", ("swin_*", "swinv2_*"), _SCRIPT),
    ("test_swin_family_compile_resize_guards", ("swin_*", "swinv2_*"), _FULLGRAPH),
    ("test_swin_family_dynamic_mask_trace", ("swin_*", "swinv2_*"), _TRACE),
]

# Markers the vendored file uses (registered so that pytest does not warn about them).
TIMM_MARKERS = ["base", "forward", "backward", "cfg", "cfg_nonstd", "torchscript", "features",
                "fxforward", "fxbackward"]


def _installed_timm() -> str:
    import timm

    return timm.__version__


# Tests vendored from another timm release may not even import (they use timm internals): leave
# the file out, and say so in the warnings summary.
collect_ignore = [] if _installed_timm() == TIMM_VERSION else ["test_models.py"]


def pytest_configure(config):
    config.addinivalue_line("markers", "timm_suite: timm's vendored test_models.py on fp8vit-converted models")
    for name in TIMM_MARKERS:
        config.addinivalue_line("markers", f"{name}: timm test_models.py marker")
    if not config.pluginmanager.hasplugin("timeout"):
        config.addinivalue_line("markers", "timeout(seconds): pytest-timeout's marker (not installed: no effect)")
    if collect_ignore:
        config.issue_config_time_warning(pytest.PytestWarning(
            f"tests/timm_suite not run: its test_models.py is timm {TIMM_VERSION}'s, timm "
            f"{_installed_timm()} is installed (re-vendor it, see its header)"), stacklevel=2)


def _in_this_folder(item) -> bool:
    return HERE in pathlib.Path(str(item.path)).parents


def _model_name(item):
    """The architecture an item is parametrized with, without a pretrained tag (``.augreg_in21k``)."""
    callspec = getattr(item, "callspec", None)
    name = callspec.params.get("model_name") if callspec is not None else None
    return name.split(".")[0] if isinstance(name, str) else None


def _matches(name: str, globs) -> bool:
    include = [g for g in globs if not g.startswith("!")]
    exclude = [g[1:] for g in globs if g.startswith("!")]
    return (any(fnmatch.fnmatchcase(name, g) for g in include)
            and not any(fnmatch.fnmatchcase(name, g) for g in exclude))


def _selected(item) -> bool:
    name, model = item.originalname, _model_name(item)
    if name in NETWORK_TESTS and not NETWORK:
        return False
    if FULL:
        return True
    if MODEL_GLOBS:
        return model is not None and _matches(model, MODEL_GLOBS)
    if name in CI_EXTRA_TESTS:
        return True
    if model is None:
        return False
    if name in SLOW_TESTS:
        return model in CI_SLOW_MODELS
    return model in CI_MODELS


def pytest_collection_modifyitems(config, items):
    keep, deselected = [], []
    for item in items:
        if not _in_this_folder(item):
            keep.append(item)
            continue
        if not _selected(item):
            deselected.append(item)
            continue
        item.add_marker(pytest.mark.timm_suite)
        keep.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = keep


def _has_timm_block(model) -> bool:
    """Whether ``model`` holds a block of one of fp8vit's families (``fp8vit.families``: timm's
    ``vision_transformer.Block``, ``eva.EvaBlock``, ...), i.e. whether convert_to_te fuses anything.
    Asked of fp8vit's own table, so that a family added there is converted here too."""
    from fp8vit.families import fp8vit_block_for

    return any(fp8vit_block_for(m) is not None for m in model.modules())


def _xfail_reason(test_name: str, model_name: str):
    for test_glob, model_globs, reason in XFAIL:
        if fnmatch.fnmatchcase(test_name, test_glob) and _matches(model_name, model_globs):
            return reason
    return None


def _mark_known_failure(node, model_name: str) -> None:
    """Mark the running test xfail(strict=True) if ``XFAIL`` lists it for this converted model."""
    reason = node is not None and _xfail_reason(node.originalname, model_name)
    if reason and not any(m.name == "xfail" for m in node.iter_markers()):
        node.add_marker(pytest.mark.xfail(reason=f"[{model_name}] {reason}", strict=True))


def _converting(create_model, node=None):
    """``create_model`` that converts what it builds (``node``: the running test, for ``XFAIL``)."""

    @functools.wraps(create_model)
    def create_and_convert(*args, **kwargs):
        import fp8vit

        model = create_model(*args, **kwargs)
        if not _has_timm_block(model):
            return model
        model_name = str(args[0] if args else kwargs.get("model_name", "")).split(".")[0]
        try:
            fp8vit.convert_to_te(model, backend="reference")  # timm's tests build on CPU/meta: no TE
        except fp8vit.ConversionError:
            raise  # a block fp8vit refuses by design: a plain failure, never one of XFAIL's
        except Exception:
            _mark_known_failure(node, model_name)  # e.g. the meta-device failure inside conversion
            raise
        _mark_known_failure(node, model_name)
        return model

    return create_and_convert


@pytest.fixture(autouse=True)
def _fp8vit_convert_created_models(request, monkeypatch):
    """Route every create_model of the test (the module's own name included) through convert_to_te."""
    if NO_CONVERT:
        yield
        return
    import timm
    import timm.models
    import timm.models._factory

    wrapped = _converting(timm.models._factory.create_model, request.node)
    monkeypatch.setattr(timm, "create_model", wrapped)
    monkeypatch.setattr(timm.models, "create_model", wrapped)
    monkeypatch.setattr(timm.models._factory, "create_model", wrapped)
    if hasattr(request.module, "create_model"):  # test_models.py did `from timm import create_model`
        monkeypatch.setattr(request.module, "create_model", wrapped)
    yield
