"""Type stubs of the native extension (``python/src``). Users call ``sparsekit.ops``, which
validates and converts its arguments first; these entry points take tensors exactly as the
ops hand them over (contiguous, int32 metadata, outputs allocated, ``stream`` the CUDA
stream's handle or ``None`` on CPU) and check them again."""

from typing import Optional, Tuple, final

import torch

__all__ = [
    "IndexKLayout",
    "KvLayout",
    "index_k_store",
    "kv_store",
    "indexer_logits",
    "topk",
    "decode_rows",
    "topk_scratch_bytes",
    "sparse_mla",
    "sparse_mla_scratch_bytes",
    "sparse_mla_v4",
    "sparse_mla_v4_scratch_bytes",
    "copy_pages",
    "page_checksums",
    "build_info",
    "cuda_driver_present",
    "__version__",
]

__version__: str

def build_info() -> Tuple[str, str, str]:
    """(the PTX archs built in, how the PTX was obtained, the CPU vector path)."""

def cuda_driver_present() -> bool: ...

@final
class IndexKLayout:
    def __new__(
        cls,
        dtype: str = "fp8_e4m3",
        head_dim: int = 128,
        page_size: int = 64,
        scale: str = "fp32",
    ) -> IndexKLayout: ...
    @property
    def dtype(self) -> str: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def scale(self) -> Optional[str]: ...
    @property
    def bytes_per_token(self) -> int: ...
    @property
    def bytes_per_page(self) -> int: ...
    @property
    def value_bytes_per_token(self) -> int: ...
    @property
    def scale_bytes_per_token(self) -> int: ...
    @property
    def scale_section_offset(self) -> Optional[int]: ...
    @property
    def fingerprint(self) -> int: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class KvLayout:
    def __new__(
        cls,
        dtype: str = "fp8_ds_mla",
        nope_dim: Optional[int] = None,
        rope_dim: Optional[int] = None,
        page_size: int = 64,
    ) -> KvLayout: ...
    @property
    def dtype(self) -> str: ...
    @property
    def nope_dim(self) -> int: ...
    @property
    def rope_dim(self) -> int: ...
    @property
    def d_qk(self) -> int: ...
    @property
    def d_v(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def bytes_per_token(self) -> int: ...
    @property
    def bytes_per_page(self) -> int: ...
    @property
    def scale_section_offset(self) -> Optional[int]: ...
    @property
    def is_v4(self) -> bool: ...
    @property
    def fingerprint(self) -> int: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

def index_k_store(
    layout: IndexKLayout,
    keys: torch.Tensor,
    slots: torch.Tensor,
    cache: torch.Tensor,
    stream: Optional[int] = None,
) -> None: ...
def kv_store(
    layout: KvLayout,
    kv: torch.Tensor,
    slots: torch.Tensor,
    cache: torch.Tensor,
    stream: Optional[int] = None,
) -> None: ...
def indexer_logits(
    layout: IndexKLayout,
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    page_table: torch.Tensor,
    rows: torch.Tensor,
    out: torch.Tensor,
    stream: Optional[int] = None,
) -> None: ...
def decode_rows(context_lens: torch.Tensor, next_n: int, out: torch.Tensor) -> None: ...
def topk_scratch_bytes(n_rows: int, row_stride: int, k: int) -> Tuple[int, int]: ...
def topk(
    logits: torch.Tensor,
    rows: torch.Tensor,
    k: int,
    out: torch.Tensor,
    page_table: Optional[torch.Tensor] = None,
    page_size: Optional[int] = None,
    workspace: Optional[torch.Tensor] = None,
    counters: Optional[torch.Tensor] = None,
    stream: Optional[int] = None,
    take_all_short_rows: bool = False,
) -> None: ...
def sparse_mla_scratch_bytes(
    layout: KvLayout, n_tokens: int, n_heads: int, topk: int
) -> Tuple[int, int]: ...
def sparse_mla(
    layout: KvLayout,
    q: torch.Tensor,
    cache: torch.Tensor,
    indices: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    workspace: Optional[torch.Tensor] = None,
    counters: Optional[torch.Tensor] = None,
    stream: Optional[int] = None,
) -> None: ...
def sparse_mla_v4_scratch_bytes(n_tokens: int, n_heads: int, total_topk: int) -> Tuple[int, int]: ...
def sparse_mla_v4(
    layout: KvLayout,
    q: torch.Tensor,
    cache: torch.Tensor,
    indices: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    lengths: Optional[torch.Tensor] = None,
    extra_layout: Optional[KvLayout] = None,
    extra_cache: Optional[torch.Tensor] = None,
    extra_indices: Optional[torch.Tensor] = None,
    extra_lengths: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    workspace: Optional[torch.Tensor] = None,
    counters: Optional[torch.Tensor] = None,
    stream: Optional[int] = None,
) -> None: ...
def copy_pages(
    layout: IndexKLayout | KvLayout,
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    stream: Optional[int] = None,
) -> None: ...
def page_checksums(
    layout: IndexKLayout | KvLayout,
    pool: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor,
    stream: Optional[int] = None,
) -> None: ...
