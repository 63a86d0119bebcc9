"""The timm zoo as a test tier: every timm model, built on the meta device and converted with
``fallback="linear"``, must convert as ``zoo_expected.json`` says (blocks fused, Linears swapped,
modules kept per reason), so that a change in what fp8vit converts fails here.

Tiers:
    default (CI)  ``CI_MODELS``, a few small models per family (about 1 minute on 2 CPU cores).
    ``-m slow``   every model of ``timm.list_models()`` (about 10 minutes on 2 cores; skipped
                  otherwise, with that reason).

A model that does not build on the meta device is recorded as ``{"error": ...}`` (its own outcome).
The file is for one timm release (``timm`` in it): with another timm installed these tests skip.

Regenerate the file after a change to what fp8vit converts (a new family, a new rule), and
review its diff:

    PYTHONPATH=. python tests/test_zoo.py --regenerate          # all models, all cores

Per-family counts for the docs, from the file: ``python tests/test_zoo.py --counts``.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import pathlib
import sys
import warnings

import pytest

EXPECTED = pathlib.Path(__file__).with_name("zoo_expected.json")

# A few small models per family (by timm module), each converting a different way: fused (vit,
# deit, naflexvit, pit, crossvit, mobilevit; eva: EVA02, PE, the RoPE ViT, Sapiens2's grouped-query
# attention, EVA-CLIP enormous's post-norm blocks), fused with blocks whose options TE_Block cannot
# honour (aimv2's SwiGLU, vitamin's GeGLU, beit3's scale_attn_norm, dinov2-giant's GluMlp,
# vit_dlittle's DiffAttention) going to the Linear fallback, fused since (swin, beit, convnext's Linear
# MLP), no fp8vit family (swinv2_cr, cait, xcit, volo, mixer) and nothing to convert (resnet,
# convnext with a conv MLP).
CI_MODELS = [
    "test_vit", "vit_tiny_patch16_224", "vit_small_patch14_reg4_dinov2", "vit_giant_patch14_dinov2",
    "vit_dlittle_patch16_reg1_gap_256", "vit_base_patch16_xp_224", "deit_tiny_distilled_patch16_224",
    "aimv2_large_patch14_224", "vitamin_small_224", "beit3_base_patch16_224", "naflexvit_base_patch16_gap",
    "pit_ti_224", "crossvit_tiny_240", "mobilevit_xxs",
    "eva02_tiny_patch14_224", "vit_pe_core_tiny_patch16_384", "vit_small_patch16_rope_224",
    "vit_large_patch16_sapiens2", "eva02_enormous_patch14_clip_224",
    "swin_tiny_patch4_window7_224", "swinv2_cr_tiny_ns_224", "beit_base_patch16_224", "cait_xxs24_224",
    "xcit_nano_12_p16_224", "volo_d1_224", "mixer_s16_224", "convnext_atto", "convnext_tiny",
    "resnet18", "test_resnet",
]


def outcome(name: str) -> dict:
    """What converting timm model ``name`` (built on the meta device) gives: ``{"fused": n,
    "linear": n, "kept": {reason: n}}``, or ``{"error": ...}`` where building or converting fails."""
    import timm
    import torch

    import fp8vit

    try:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
    except Exception as err:  # noqa: BLE001 - a model that cannot be built on meta is an outcome
        return {"error": f"build: {type(err).__name__}: {err}"[:300]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the summary below says what a warning would
        try:
            model = fp8vit.convert_to_te(model, backend="reference", fallback="linear")
        except Exception as err:  # noqa: BLE001 - recorded, so that the expected file shows it
            return {"error": f"convert: {type(err).__name__}: {err}"[:300]}
    return fp8vit.conversion_summary(model).counts()


def scan(names, jobs: int = 1) -> dict:
    """``{name: outcome(name)}``, over ``jobs`` processes."""
    if jobs <= 1:
        return {n: outcome(n) for n in names}
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        return dict(zip(names, pool.map(outcome, names, chunksize=4)))


def _expected() -> dict:
    import timm

    data = json.loads(EXPECTED.read_text())
    if data["timm"] != timm.__version__:
        pytest.skip(f"{EXPECTED.name} is for timm {data['timm']}, timm {timm.__version__} is installed "
                    f"(regenerate it: python tests/test_zoo.py --regenerate)")
    return data["models"]


def _diff(expected: dict, got: dict) -> list:
    return [f"{n}: expected {expected.get(n, 'no entry')}, got {got[n]}" for n in got if expected.get(n) != got[n]]


@pytest.mark.parametrize("name", CI_MODELS)
def test_zoo_subset_converts_as_expected(name):
    expected = _expected()
    assert name in expected, f"{name} is not a model of this timm; update CI_MODELS"
    got = outcome(name)
    assert got == expected[name], (f"{name}: expected {expected[name]}, got {got}. If the change is "
                                   "intended, regenerate: python tests/test_zoo.py --regenerate")


@pytest.mark.slow
def test_whole_zoo_converts_as_expected(request):
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("slow tier: every timm model (about 10 minutes on 2 cores); run with -m slow")
    import timm

    expected = _expected()
    names = timm.list_models()
    got = scan(names, jobs=os.cpu_count() or 1)
    missing = sorted(set(expected) - set(got))
    bad = _diff(expected, got)
    assert not bad and not missing, (f"{len(bad)} of {len(names)} models convert otherwise than "
                                     f"{EXPECTED.name} says (regenerate it if intended: python "
                                     f"tests/test_zoo.py --regenerate):\n" + "\n".join(bad[:50])
                                     + (f"\nno longer in timm: {missing[:20]}" if missing else ""))


def counts_by_family(models: dict) -> dict:
    """``{timm module: {outcome class: models}}``: fused (all blocks fp8vit's), fused+linear,
    linear, kept (blocks, but nothing in FP8), none (no block), error."""
    import timm

    module_of = {n: m for m in timm.list_modules() for n in timm.list_models(module=m)}
    table: dict = collections.defaultdict(collections.Counter)
    for name, o in models.items():
        if "error" in o:
            cls = "error"
        elif o["fused"] and o["linear"]:
            cls = "fused+linear"
        elif o["fused"]:
            cls = "fused"
        elif o["linear"]:
            cls = "linear"
        else:
            cls = "kept" if o["kept"] else "none"
        table[module_of.get(name, "?")][cls] += 1
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Regenerate or summarize tests/zoo_expected.json.")
    p.add_argument("--regenerate", action="store_true", help="scan every timm model and write the file")
    p.add_argument("--counts", action="store_true", help="print per-family outcome counts from the file")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    a = p.parse_args(argv)
    if a.regenerate:
        import timm

        models = scan(timm.list_models(), a.jobs)
        EXPECTED.write_text(json.dumps({"timm": timm.__version__, "models": models}, indent=1, sort_keys=True)
                            + "\n")
        print(f"wrote {EXPECTED} ({len(models)} models)")
    if a.counts:
        table = counts_by_family(json.loads(EXPECTED.read_text())["models"])
        classes = ["fused", "fused+linear", "linear", "kept", "none", "error"]
        print("| timm module | " + " | ".join(classes) + " |\n|" + " --- |" * (len(classes) + 1))
        for module in sorted(table):
            print(f"| {module} | " + " | ".join(str(table[module][c] or "") for c in classes) + " |")
        total = collections.Counter()
        for c in table.values():
            total.update(c)
        print("| all | " + " | ".join(str(total[c]) for c in classes) + " |")
    if not (a.regenerate or a.counts):
        p.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
