"""fp8vit's tools, on top of the library (which never imports them): the shared workload harness
(``workload``), ``fp8vit-bench`` (``bench``), ``fp8vit-profile`` (``profiling``) and
``fp8vit-diagnose`` (``diagnose``)."""
