"""The block families and what they share (the layer above the TE seam, below training).

=================  ===================================================================================
``vit``            ``TE_Block``: timm's classic ``vision_transformer.Block``
``eva``            ``TE_EvaBlock``: timm's ``EvaBlock`` / ``EvaBlockPostNorm`` (EVA02, RoPE ViTs, PE, ...)
``beit``           ``TE_BeitBlock``: timm's BEiT ``Block`` (EVA's layout and a relative position bias)
``swin``           ``TE_SwinBlock``: timm's ``SwinTransformerBlock`` (EVA's layout on shifted windows)
``convnext``       ``TE_ConvNeXtBlock``: timm's ``ConvNeXtBlock`` (its norm and Linear MLP fused, the conv in torch)
``families``       the registry timm block class -> fp8vit block class that ``convert_to_te`` consults
``base``           ``FP8Block``, the base of every family: switches, the FP8 plumbing of ``forward``,
                   one attention path (with a RoPE hook), token-row padding, LayerScale
``config``         ``BlockConfig``: timm ``Block`` keywords, validated
``mlp``            the MLPs (GELU, SwiGLU, GLU; fused or not; hidden widths padded for FP8)
``timm_layers``    timm's norms and activations -> TE's kernels
``weights``        parameter layouts timm <-> TE, bit for bit
``linear``         the FP8 ``Linear`` swapped into blocks fp8vit does not fuse
``patch_embed``    the patch embedding's convolution as one GEMM (``set_patch_gemm``)
``model_norm``     the model's own LayerNorms (final ``norm``, ...) in one pass under autocast
``backend``        TE's modules on the GPU, or ``reference``'s pure-torch stand-ins (CPU, tests)
=================  ===================================================================================

A family is one module plus one line in ``families.FAMILIES``; families never import each other
(``lint-imports``), except that ``beit`` and ``swin`` extend ``eva``. Import the public names from ``fp8vit``.
"""
