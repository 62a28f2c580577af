//! The kernels, generic over [`Simt`](crate::Simt). Each is an `unsafe fn` whose contract
//! is stated on it; launchers establish the contract from validated host descriptors.

/// Repeats `$b` with `$i` bound to `0, 1, .., N - 1` (a literal count): a forced unroll,
/// so that register arrays are only indexed by constants (no local memory). Each copy
/// holds an [`UnrollScope`], which tells the emulator's access tracing the copies apart
/// (and is nothing on the GPU).
macro_rules! unroll {
    (2, $i:ident, $b:block) => { unroll!(@ $i, $b, 0 1) };
    (4, $i:ident, $b:block) => { unroll!(@ $i, $b, 0 1 2 3) };
    (8, $i:ident, $b:block) => { unroll!(@ $i, $b, 0 1 2 3 4 5 6 7) };
    (9, $i:ident, $b:block) => { unroll!(@ $i, $b, 0 1 2 3 4 5 6 7 8) };
    (16, $i:ident, $b:block) => {
        unroll!(@ $i, $b, 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15)
    };
    (@ $i:ident, $b:block, $($n:literal)*) => {
        $( {
            let $i: usize = $n;
            let _scope = $crate::kernels::UnrollScope::enter($n);
            $b
        } )*
    };
}

/// The copy of a forced unroll being executed (see `unroll!`): in the emulator, while a
/// launch is traced, its accesses are recorded as those of this copy; on the GPU, and in
/// untraced launches, nothing.
#[doc(hidden)]
#[derive(Debug)]
pub struct UnrollScope(());

impl UnrollScope {
    /// Enters copy `i`.
    #[inline(always)]
    pub fn enter(i: u32) -> Self {
        #[cfg(feature = "emu")]
        crate::emu::unroll_enter(i);
        let _ = i;
        UnrollScope(())
    }
}

impl Drop for UnrollScope {
    #[inline(always)]
    fn drop(&mut self) {
        #[cfg(feature = "emu")]
        crate::emu::unroll_exit();
    }
}

mod dense;
mod indexer_logits;
mod pages;
mod sparse_mla;
mod sparse_mla_v4;
mod store;
mod topk;

pub use dense::{
    argmax_launch, dense_add, dense_argmax, dense_cast, dense_gated_pool, dense_gather_rows,
    dense_matmul, dense_rms_norm, dense_rope, dense_swiglu, elementwise_launch, matmul_launch,
    row_launch, ARGMAX_BLOCK, ELEMENTWISE_BLOCK, MATMUL_TILE_COLS, MATMUL_TILE_ROWS, ROW_WARPS,
};
pub use indexer_logits::{
    indexer_logits, indexer_logits_fp4, indexer_logits_launch,
    MAX_HEAD_DIM as INDEXER_LOGITS_MAX_HEAD_DIM,
};
pub use pages::{copy_pages, page_checksums};
pub use sparse_mla::{sparse_mla, sparse_mla_launch, sparse_mla_split, sparse_mla_workspace};
pub use sparse_mla_v4::{
    sparse_mla_v4, sparse_mla_v4_launch, sparse_mla_v4_split, sparse_mla_v4_workspace,
    SMEM as SPARSE_MLA_V4_SMEM,
};
pub use store::{index_k_store, kv_store};
pub use topk::{topk, topk_chunk, topk_launch, topk_workspace};

/// Full-warp mask.
pub const FULL: u32 = u32::MAX;

/// Butterfly max over the 32 lanes of a full warp (exact: max is order-independent).
#[inline(always)]
pub fn warp_max_f32<S: crate::Simt>(mut v: f32) -> f32 {
    let mut m = 16;
    while m > 0 {
        v = v.max(S::shfl_xor_f32(FULL, v, m));
        m >>= 1;
    }
    v
}

/// Butterfly wrapping sum of a u64 over the 32 lanes of a full warp.
#[inline(always)]
pub fn warp_sum_u64<S: crate::Simt>(mut v: u64) -> u64 {
    let mut m = 16;
    while m > 0 {
        let lo = S::shfl_xor(FULL, v as u32, m) as u64;
        let hi = S::shfl_xor(FULL, (v >> 32) as u32, m) as u64;
        v = v.wrapping_add(lo | (hi << 32));
        m >>= 1;
    }
    v
}
