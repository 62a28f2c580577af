//! Launch geometry of every kernel, shared by the emulator backend and the CUDA launcher so
//! both run the same blocks.

/// Grid and block sizes (1-D) and dynamic shared memory in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    pub grid: u32,
    pub block: u32,
    pub smem_bytes: u32,
}

/// Warps (tokens) per block of the store kernels.
pub const STORE_WARPS: u32 = 4;
/// Upper bound on blocks of grid-stride kernels.
pub const MAX_GRID: u32 = 65_535;
/// Most dynamic shared memory a launch may ask for (SM120 allows ~99 KiB per block).
pub const MAX_DYN_SMEM: u32 = 99 * 1024;

/// `index_k_store` / `kv_store`: one warp per token.
pub fn store(n_tokens: u32) -> Launch {
    Launch {
        grid: n_tokens.div_ceil(STORE_WARPS).clamp(1, MAX_GRID),
        block: 32 * STORE_WARPS,
        smem_bytes: 0,
    }
}

/// `copy_pages`: one block per page.
pub fn copy_pages(n_pages: u32) -> Launch {
    Launch {
        grid: n_pages.clamp(1, MAX_GRID),
        block: 256,
        smem_bytes: 0,
    }
}

/// Threads per block of `page_checksums`.
pub const CHECKSUM_BLOCK: u32 = 256;

/// `page_checksums`: one block per page, one u64 of shared memory per warp.
pub fn page_checksums(n_pages: u32) -> Launch {
    Launch {
        grid: n_pages.clamp(1, MAX_GRID),
        block: CHECKSUM_BLOCK,
        smem_bytes: CHECKSUM_BLOCK / 32 * 8,
    }
}
