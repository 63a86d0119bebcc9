"""TE_BeitBlock on the GPU: TE's attention with the relative position bias (cuDNN's post_scale_bias,
its gradient into the table) against timm with FP8 off (tight), FP8 against bf16 by SNR, any batch
under FP8, the k bias held at zero, per-block CUDA graphs.

Tolerances as in test_eva_gpu.py (fp32: different kernels, 2e-3 of the output's max; logits >= 20
dB and weight gradients >= 12 dB under FP8).
"""

import pytest
import timm
import torch

import fp8vit
from fp8vit.blocks.beit import TE_BeitBlock
from helpers import fp8_snrs, max_rel_err, rel_l2_err, snr_db, train_steps

pytestmark = pytest.mark.gpu

# BEiT-B (q/v biases, a table per block, LayerScale) and BEiT v2 at its options; the shared table
# (one bias handed to every block) as Beit builds it with use_shared_rel_pos_bias.
MODELS = {
    "beit_base_patch16_224": dict(embed_dim=256, num_heads=4),
    "beitv2_base_patch16_224": dict(embed_dim=256, num_heads=4),
    "beit_base_patch16_224.shared": dict(embed_dim=256, num_heads=4, use_rel_pos_bias=False,
                                         use_shared_rel_pos_bias=True),
}


def _model(key, depth=2):
    torch.manual_seed(0)
    m = timm.create_model(key.split(".")[0], pretrained=False, depth=depth, num_classes=100, **MODELS[key])
    with torch.no_grad():  # non-zero biases and table, so that every tensor counts
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return m.cuda()


def _convert(model):
    fp8vit.convert_to_te(model, exact_gelu=True)  # BEiT's GELU is erf
    assert {type(b) for b in model.blocks} == {TE_BeitBlock}
    return model


@pytest.mark.parametrize("key", list(MODELS))
def test_fp32_logits_and_grads_match_timm(key):
    model = _model(key).eval()
    x = torch.randn(2, 3, 224, 224, device="cuda", requires_grad=True)

    def run(net):  # logits, input gradient; the parameters' gradients in .grad
        # one backward: TE's modules free what their backward needs after it (no retain_graph)
        x.grad = None
        out = net(x)
        out.square().sum().backward()
        return out.detach(), x.grad.clone()

    ref, dx_ref = run(model)
    tables = {n: p.grad.clone() for n, p in model.named_parameters() if "relative_position_bias_table" in n}
    te = _convert(model)
    te.zero_grad(set_to_none=True)
    out, dx = run(te)
    got = {n.replace("attn.", ""): p.grad for n, p in te.named_parameters() if "relative_position_bias_table" in n}
    errs = {n: rel_l2_err(g, got[n.replace("attn.", "")]) for n, g in tables.items()}
    print(f"{key}: fp32 logits max rel err {max_rel_err(ref, out):.2e}, dx rel L2 {rel_l2_err(dx_ref, dx):.2e}, "
          f"table grads rel L2 {({n: f'{e:.1e}' for n, e in errs.items()})}")
    assert max_rel_err(ref, out) < 2e-3 and rel_l2_err(dx_ref, dx) < 2e-3
    assert tables and all(e < 2e-3 for e in errs.values())


@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("batch", [16, 3])  # 3 x 197 rows: padded to a multiple of 16
def test_fp8_snr_vs_bf16(recipe, batch):
    model = _convert(_model("beit_base_patch16_224")).train()
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    snrs, worst, _, _ = fp8_snrs(model, x, recipe, lambda k, _: k.startswith("blocks.")
                                 and k.endswith(("weight", "relative_position_bias_table")))
    print(f"beit {recipe} batch {batch}: logits {snrs['logits']:.1f} dB, worst {worst} {snrs[worst]:.1f} dB")
    assert snrs["logits"] >= 20.0 and snrs[worst] >= 12.0


def test_per_block_graphs_train_like_eager():
    # BEiT's blocks sit in an nn.ModuleList and get shared_rel_pos_bias=None by keyword: one graph
    # pair per block; the gather from the table and its scatter-add run inside the graphs.
    g = torch.Generator("cuda").manual_seed(1)
    data = [(torch.randn(16, 3, 224, 224, device="cuda", generator=g),
             torch.randint(0, 100, (16,), device="cuda", generator=g)) for _ in range(4)]
    eager = _convert(_model("beit_base_patch16_224", depth=3)).train()
    graphed = _convert(_model("beit_base_patch16_224", depth=3)).train()
    handle = fp8vit.make_graphed_blocks(graphed, 16, recipe="delayed", fused_wgrad=False)

    def train(model):
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        return train_steps(model, data, opt, lambda: fp8vit.fp8_context("delayed"))

    le, lg = train(eager), train(graphed)
    print(f"beit graphed: eager losses {le}, graphed {lg}")
    assert handle.per_block and handle.replays == len(data) * 3 and handle.eager_calls == 0
    for (n, a), b in zip(eager.named_parameters(), graphed.parameters()):
        assert snr_db(a, b) > 40, n
    A = graphed.blocks[0].cfg.attn_dim
    assert all(torch.count_nonzero(b.qkv.bias[A:2 * A]) == 0 for b in graphed.blocks)
    assert all(torch.count_nonzero(b.relative_position_bias_table) > 0 for b in graphed.blocks)
