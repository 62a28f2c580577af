"""Drop-in modules with the anchors' signatures and conventions, over sparsekit's kernels.

- ``sparsekit.compat.deep_gemm``: ``fp8_mqa_logits``, ``fp8_paged_mqa_logits``,
  ``get_paged_mqa_logits_metadata`` (DeepGEMM ``54e22612``);
- ``sparsekit.compat.flash_mla``: ``get_mla_metadata``, ``flash_mla_with_kvcache``
  (sparse form), ``flash_mla_sparse_fwd`` (FlashMLA ``9241ae3e``);
- ``sparsekit.compat.sgl_kernel``: ``fast_topk_v2``, ``fast_topk_transform_fused``,
  ``fast_topk_transform_ragged_fused``, ``deepseek_v4_topk_transform_512`` (sgl-kernel's
  top-k as SGLang's DSA backend calls it).

A deployment swaps the import::

    from sparsekit.compat import deep_gemm, flash_mla, sgl_kernel

Each module's docstring lists what it accepts beyond its anchor.
"""

from . import deep_gemm, flash_mla, sgl_kernel

__all__ = ["deep_gemm", "flash_mla", "sgl_kernel"]
