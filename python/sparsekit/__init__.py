"""sparsekit: DeepSeek Sparse Attention kernels on torch tensors.

- ``sparsekit.ops``: every op of the library (index-K and KV stores, the lightning
  indexer's logits, exact top-k, sparse MLA attention, page copies and checksums) on torch
  tensors, CPU or CUDA.
- ``sparsekit.compat.deep_gemm`` / ``.flash_mla`` / ``.sgl_kernel``: the signatures and
  conventions of DeepGEMM, FlashMLA and sgl-kernel's top-k, so a deployment swaps an import.
- ``IndexKLayout``, ``KvLayout``: the cache layout descriptors (bytes per token and page,
  fingerprints), the same ones the Rust crates use.

Importing needs neither a GPU nor torch; ``sparsekit.ops`` and ``sparsekit.compat`` import
torch. On a CUDA tensor the CUDA driver is loaded the first time, and the call is enqueued
on the caller's current torch stream.
"""

from ._native import IndexKLayout, KvLayout, __version__, build_info, cuda_driver_present

__all__ = [
    "IndexKLayout",
    "KvLayout",
    "__version__",
    "build_info",
    "cuda_driver_present",
    "ops",
    "compat",
]


def __getattr__(name):
    # `sparsekit.ops` and `sparsekit.compat` import torch: only when asked for.
    if name in ("ops", "compat"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'sparsekit' has no attribute {name!r}")
