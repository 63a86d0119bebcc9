"""fp8vit-scaleplan's formulas (docs/scaling.md): the models are timm's, the activation and memory
terms reproduce the one measured ViT-H/16 peak, and the modes relate as their definitions say."""

import pytest
import timm
import torch

from fp8vit.tools import scaleplan


@pytest.mark.parametrize("label, timm_name", [("ViT-H/14", "vit_huge_patch14_224"), ("ViT-g/14", "vit_giant_patch14_224"),
                                              ("ViT-G/14", "vit_gigantic_patch14_224")])
def test_models_are_timms(label, timm_name):
    with torch.device("meta"):
        model = timm.create_model(timm_name, num_classes=1000)  # scaleplan counts a 1000-class head
    s = scaleplan.shape_of(scaleplan.MODELS[label])
    assert s.params == sum(p.numel() for p in model.parameters())
    assert (s.depth, s.dim, s.mlp, s.tokens) == (len(model.blocks), model.embed_dim,
                                                 model.blocks[0].mlp.fc1.out_features, 257)


def test_formulas_reproduce_the_measured_vit_h16_peak():
    # docs/results/bench/vit_huge_patch16_224_b128_all10_h200.json: 33.76 GiB; about 212 MB of
    # activations per image, 110 MB with every MLP recomputed (the largest batches of lever 7,
    # docs/performance.md)
    chk = scaleplan.anchor_check()
    assert chk["computed_gib"] == pytest.approx(chk["measured_gib"], rel=0.05)
    assert chk["activations_mb_per_image"] == pytest.approx(212, rel=0.05)
    assert chk["recompute_activations_mb_per_image"] == pytest.approx(110, rel=0.05)


def test_modes_relate_as_defined():
    s = scaleplan.shape_of(scaleplan.MODELS["ViT-H/14"])
    ddp, fsdp = scaleplan.memory(s, "ddp", 8), scaleplan.memory(s, "fsdp2", 8)
    assert fsdp["states"] == pytest.approx(ddp["states"] / 8)
    # FP8 weights save 3 bytes per GEMM weight and add a 4-byte fp32 master: slightly more memory...
    assert scaleplan.memory(s, "fsdp2-fp8w", 8)["states"] > fsdp["states"]
    # ... and a quarter less traffic: GEMM weights gathered in 1 byte instead of 2, twice
    c = {m: scaleplan.comm_bytes(s, m, 8) for m in scaleplan.MODES}
    assert c["fsdp2"] == pytest.approx(c["ddp"], rel=0.01)  # bf16 gathers + fp32 reduce-scatter = fp32 all-reduce
    assert c["fsdp2-fp8w"] == pytest.approx(0.75 * c["fsdp2"], rel=0.02)
    assert scaleplan.comm_bytes(s, "ddp", 1) == 0


def test_main_prints_the_tables(capsys):
    assert scaleplan.main(["--models", "ViT-H/14", "--gpus", "8", "16"]) == 0
    out = capsys.readouterr().out
    assert "anchor: ViT-H/16" in out and "| ViT-H/14 | FSDP2 + FP8 weights | 16 |" in out


def test_docs_tables_are_the_tools_output(capsys):
    # docs/scaling.md quotes fp8vit-scaleplan's output for these arguments: a formula changed here
    # must be regenerated there (python -m fp8vit.tools.scaleplan with the same arguments)
    import os
    doc = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "scaling.md")
    scaleplan.main(["--gpus", "8", "64", "--models", "ViT-H/14", "ViT-22B"])
    tables = capsys.readouterr().out.split("\n", 2)[2]  # after the anchor line and a blank one
    assert tables.strip() in open(doc).read()
