"""examples/train_vit.py on the GPU: the ms/step it prints is the GPU's time, not the host's; by default
it runs the blocks as CUDA graphs, every step replayed (an image folder's last, smaller batch dropped)."""

import pytest
import timm
import torch

import fp8vit
from helpers import load_example

pytestmark = pytest.mark.gpu


class _GPUBound(torch.nn.Module):
    """``model`` after a GPU-side spin of ``cycles`` clock cycles per forward: the GPU takes far
    longer than the host needs to issue the step, as in a CUDA-graphed step. That is where a clock
    read without a synchronization reported the host's queueing speed (19.6 ms/step for a 28.3 ms
    step, issue 24); for a step whose host time exceeds its GPU time, that read is right anyway."""

    def __init__(self, model, cycles):
        super().__init__()
        self.model, self.cycles = model, cycles

    def forward(self, x):
        torch.cuda._sleep(self.cycles)
        return self.model(x)


def _spin_cycles(ms):
    """Clock cycles of ``torch.cuda._sleep`` that take about ``ms`` milliseconds on this GPU."""
    probe = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(probe)  # first launch outside the measurement
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * ms / start.elapsed_time(end))


def test_train_example_step_lines_report_cuda_event_time():
    ex = load_example("train_vit")
    torch.manual_seed(0)
    model = timm.create_model("vit_base_patch16_224", pretrained=False, depth=2, num_classes=10)
    model = fp8vit.convert_to_te(model.cuda()).train()
    spin_ms = 25.0
    net = _GPUBound(model, _spin_cycles(spin_ms))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator("cuda").manual_seed(0)
    batch = (torch.randn(16, 3, 224, 224, device="cuda", generator=g),
             torch.randint(0, 10, (16,), device="cuda", generator=g))
    kw = dict(device=torch.device("cuda"), images_per_step=16)
    ex.train_epoch(net, opt, [batch] * 2, log=None, **kw)  # warm-up: TE's first-call setup
    torch.cuda.synchronize()

    lines = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step, _, readouts = ex.train_epoch(net, opt, [batch] * 12, log_every=4, log=lines.append, **kw)
    end.record()
    end.synchronize()
    event_ms = start.elapsed_time(end) / 12

    assert step == 12 and [r["step"] for r in readouts] == [4, 8, 12] and len(lines) == 3
    assert event_ms > spin_ms  # the step is GPU-bound, so a host-clock readout would be far lower
    for r, line in zip(readouts, lines):
        assert r["ms_per_step"] > spin_ms, readouts  # every step line, not only their sum
        assert f"{r['ms_per_step']:7.1f} ms/step" in line and f"{16 / r['ms_per_step'] * 1e3:8.1f} img/s" in line
    reported_ms = sum(r["ms_per_step"] * r["steps"] for r in readouts) / 12
    assert reported_ms == pytest.approx(event_ms, rel=0.05), (reported_ms, event_ms)


def _main_recording_graphs(argv, monkeypatch, capsys):
    """examples/train_vit.py's main(argv); returns (its output, the GraphedBlocks it captured)."""
    ex = load_example("train_vit")
    handles = []
    capture = fp8vit.make_graphed_blocks

    def recording(*args, **kwargs):
        handles.append(capture(*args, **kwargs))
        return handles[-1]

    monkeypatch.setattr(fp8vit, "make_graphed_blocks", recording)
    capsys.readouterr()
    ex.main(argv)
    return capsys.readouterr().out, handles


def test_train_example_graphs_the_blocks_by_default_and_eager_is_a_flag(monkeypatch, capsys, recwarn):
    # issue 32: the newcomer's first run (only shorter) takes the fast path: every step replays the
    # graphs, none falls back to eager
    argv = ["--batch-size", "32", "--steps", "6", "--num-classes", "10", "--workers", "0"]
    out, handles = _main_recording_graphs(argv, monkeypatch, capsys)
    assert "blocks: CUDA-graphed blocks (the default on an FP8 GPU; --eager runs them eagerly)" in out, out
    assert len(handles) == 1 and handles[0].replays == 6 and handles[0].eager_calls == 0, handles
    assert not [w for w in recwarn if "run eagerly" in str(w.message)]
    out, handles = _main_recording_graphs(argv + ["--eager"], monkeypatch, capsys)
    assert "blocks: eager (--eager)" in out and handles == []


def test_train_example_graphed_on_an_image_folder_drops_the_last_smaller_batch(tmp_path, monkeypatch, capsys,
                                                                              recwarn):
    from PIL import Image
    for cls in ("a", "b"):
        (tmp_path / cls).mkdir()
        for i in range(5):  # 10 images, batch 4: 2 full batches an epoch, the last 2 images dropped
            Image.new("RGB", (40, 40), (50 * i, 100 if cls == "a" else 200, 0)).save(tmp_path / cls / f"{i}.png")
    argv = ["--model", "vit_tiny_patch16_224", "--data", str(tmp_path), "--num-classes", "2", "--batch-size", "4",
            "--epochs", "2", "--workers", "0", "--log-every", "1"]
    out, handles = _main_recording_graphs(argv, monkeypatch, capsys)
    assert "blocks: CUDA-graphed blocks" in out and "done: 4 steps" in out, out
    assert handles[0].replays == 4 and handles[0].eager_calls == 0, handles
    assert not [w for w in recwarn if "run eagerly" in str(w.message)]
