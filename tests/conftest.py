"""Test tiers: CPU logic (default), ``-m gpu`` numerics that need CUDA + Transformer Engine."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def _gpu_skip_reason():
    import torch

    import fp8vit._te as _te
    if not torch.cuda.is_available():
        return f"needs a CUDA GPU (torch {torch.__version__}: none visible)"
    ok, reason = _te.te_status()
    return None if ok else f"needs Transformer Engine: {reason}"


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if "gpu" in item.keywords:
            reason = reason or _gpu_skip_reason() or ""
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
