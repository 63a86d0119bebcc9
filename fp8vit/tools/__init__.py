"""fp8vit's tools, on top of the library (which never imports them): the shared workload harness
(``workload``), ``fp8vit-bench`` (``bench``), ``fp8vit-profile`` (``profiling``),
``fp8vit-diagnose`` (``diagnose``) and ``fp8vit-scaleplan`` (``scaleplan``: computed memory and
communication of multi-GPU training, docs/scaling.md)."""
