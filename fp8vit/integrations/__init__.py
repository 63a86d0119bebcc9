"""fp8vit inside training frameworks, each module importing its framework (an optional extra) and
only fp8vit's public API; ``import fp8vit`` never imports them (docs/frameworks.md).

- :mod:`fp8vit.integrations.lightning`: ``FP8VitPrecision``, a Lightning precision plugin
  (``Trainer(plugins=[FP8VitPrecision()])``; ``pip install "fp8vit[lightning]"``).

timm's ``train.py``, HF accelerate and ``torch.compile`` need no code here: ``convert_to_te(model,
autocast=True)`` makes a model that trains in FP8 inside any bf16 loop.
"""
