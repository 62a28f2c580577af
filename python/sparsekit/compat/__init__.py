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

__all__ = ["deep_gemm", "flash_mla", "sgl_kernel", "install"]


_ANCHORS = {
    "deep_gemm": (deep_gemm, deep_gemm.__all__),
    "flash_mla": (flash_mla, flash_mla.__all__),
    "sgl_kernel": (sgl_kernel, sgl_kernel.__all__),
}


def install(names=("deep_gemm", "flash_mla", "sgl_kernel")):
    """Makes ``import deep_gemm`` / ``flash_mla`` / ``sgl_kernel`` (and the functions
    imported from them afterwards) resolve to sparsekit's: where the anchor's module is
    importable, its DSA functions are replaced on it (its other kernels, DeepGEMM's GEMMs
    say, stay); where it is not (SM120 machines without those wheels), sparsekit's module
    is registered under its name. Call it before the serving framework imports them.
    Returns ``{name: "patched" | "registered"}``."""
    import importlib
    import sys

    done = {}
    for name in names:
        ours, functions = _ANCHORS[name]
        try:
            theirs = importlib.import_module(name)
        except Exception:  # not installed, or fails to import on this GPU
            sys.modules[name] = ours
            done[name] = "registered"
            continue
        for f in functions:
            setattr(theirs, f, getattr(ours, f))
        if name == "sgl_kernel" and "sgl_kernel.top_k" in sys.modules:
            for f in functions:
                setattr(sys.modules["sgl_kernel.top_k"], f, getattr(ours, f))
        done[name] = "patched"
    return done
