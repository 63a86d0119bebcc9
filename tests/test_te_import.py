"""The TE import boundary explains failures; import fp8vit works without TE."""

import subprocess
import sys

from fp8vit import _te


def test_not_installed_gives_install_command():
    err = ModuleNotFoundError("No module named 'transformer_engine'", name="transformer_engine")
    reason = _te._explain_import_error(err)
    assert "not installed" in reason and "pip install 'fp8vit[te]'" in reason


def test_cudnn_clash_is_named_with_fix():
    err = ImportError("/usr/lib/libcudnn_cnn.so.9: undefined symbol: cudnnGetLibConfig, version libcudnn_graph.so.9")
    reason = _te._explain_import_error(err)
    assert "different cuDNN" in reason and "undefined symbol" in reason
    assert "before running any model" in reason and "CUDNN_PATH" in reason


def test_other_errors_keep_the_message():
    reason = _te._explain_import_error(RuntimeError("boom 42"))
    assert "boom 42" in reason and "RuntimeError" in reason


def test_import_fp8vit_without_te_or_gpu():
    # A fresh interpreter with TE hidden: the package imports and reports why FP8 is off.
    code = ("import sys; sys.modules['transformer_engine'] = None\n"
            "import fp8vit\n"
            "print(*fp8vit._te.te_status()); print(*fp8vit.fp8_support())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    te_line, fp8_line = out.splitlines()
    assert te_line.startswith("False") and "not installed" in te_line
    assert fp8_line.startswith("False")  # and says why: no GPU here, or no TE on a GPU machine


def test_load_te_raises_with_reason(monkeypatch):
    monkeypatch.setattr(_te, "_import", lambda: (None, "because reasons"))
    try:
        _te.load_te()
    except _te.TEUnavailableError as err:
        assert "because reasons" in str(err)
    else:
        raise AssertionError("load_te did not raise")
