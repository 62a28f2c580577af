//! The typed kernel interface: every kernel is named by its `#[repr(C)]` parameter struct
//! ([`KernelParams`]), which carries the PTX entry name, the launch geometry and the kernel
//! body. One macro declares all of it, and from the same list the nvptx entry points and
//! [`ENTRY_POINTS`]; the emulator and the CUDA launcher take `P: KernelParams`, so a kernel
//! can only ever be launched with its own parameters.
//!
//! The kernel is chosen by the parameter type; there is no name to get wrong, and a type
//! that is not one of the kernels' parameter structs cannot be launched at all
//! ([`KernelParams`] is sealed):
//!
//! ```compile_fail,E0277
//! use sparsekit_kernels::launch::KernelParams;
//! /// A look-alike of `IndexKStoreParams`, not a kernel's parameters.
//! #[repr(C)]
//! #[derive(Clone, Copy, Debug)]
//! struct LookAlike([u64; 6]);
//! fn launch<P: KernelParams>(_: P) {}
//! launch(LookAlike([0; 6]));
//! ```
//!
//! ```compile_fail,E0277
//! use sparsekit_kernels::launch::KernelParams;
//! #[repr(C)]
//! #[derive(Clone, Copy, Debug)]
//! struct LookAlike([u64; 6]);
//! // Sealed: no type outside this crate can claim an entry point.
//! impl KernelParams for LookAlike {
//!     const ENTRY: &'static str = "index_k_store";
//!     fn launch(&self) -> sparsekit_kernels::launch::Launch { unimplemented!() }
//!     unsafe fn run<S: sparsekit_kernels::Simt>(self) {}
//! }
//! ```
//!
//! Asking for one kernel and passing another's parameters is a type error:
//!
//! ```compile_fail,E0308
//! use sparsekit_kernels::launch::KernelParams;
//! use sparsekit_kernels::params::{IndexKStoreParams, KvStoreParams};
//! fn launch<P: KernelParams>(_: P) {}
//! fn store(p: KvStoreParams) {
//!     launch::<IndexKStoreParams>(p);
//! }
//! ```
//!
//! ```
//! use sparsekit_kernels::launch::KernelParams;
//! use sparsekit_kernels::params::{CopyPagesParams, IndexKStoreParams};
//! assert_eq!(IndexKStoreParams::ENTRY, "index_k_store");
//! assert_eq!(CopyPagesParams::ENTRY, "copy_pages");
//! assert_eq!(sparsekit_kernels::ENTRY_POINTS.len(), 18);
//! ```

use crate::kernels;
use crate::params::{
    CopyPagesParams, DenseAddParams, DenseArgmaxParams, DenseCastParams, DenseGatedPoolParams,
    DenseGatherRowsParams, DenseMatmulParams, DenseRmsNormParams, DenseRopeParams,
    DenseSwiGluParams, IndexKStoreParams, IndexerLogitsFp4Params, IndexerLogitsParams,
    KvStoreParams, PageChecksumsParams, SparseMlaParams, SparseMlaV4Params, TopkParams,
};
use crate::simt::Simt;

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
/// Dynamic shared memory a kernel gets without opting in (a launcher above it must raise
/// the function's limit first).
pub const DEFAULT_DYN_SMEM: u32 = 48 * 1024;

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

mod sealed {
    /// Only the parameter structs declared by `kernels!` implement [`super::KernelParams`].
    pub trait Sealed {}
}

/// The by-value parameter struct of exactly one kernel (sealed: implemented only by the
/// structs of [`crate::params`], through the `kernels!` declaration below).
///
/// Launchers take `P: KernelParams` and launch `P::ENTRY` with `params.launch()`; the
/// emulator runs `P::run::<Emu>`, the nvptx entry point `P::run::<Device>`.
pub trait KernelParams: sealed::Sealed + Copy + core::fmt::Debug + 'static {
    /// The kernel's PTX `.entry` name (also its name in [`crate::kernels`]).
    const ENTRY: &'static str;

    /// The grid, block and dynamic shared memory the kernel is launched with for these
    /// parameters (the same on the GPU and in the emulator).
    fn launch(&self) -> Launch;

    /// The kernel body of the calling GPU thread.
    ///
    /// # Safety
    /// The kernel's contract (see its function in [`crate::kernels`]): launched with
    /// [`Self::launch`]'s geometry, every pointer valid for what the kernel reads and
    /// writes for the whole launch, and no other access racing with those writes.
    unsafe fn run<S: Simt>(self);
}

/// Declares the kernels: `name(Params) => geometry;` implements [`KernelParams`] for
/// `Params` (entry `name`, body `kernels::name`, geometry a `fn(&Params) -> Launch`),
/// lists the names in [`ENTRY_POINTS`] and, on nvptx64, exports the `extern "ptx-kernel"`
/// entry point `name(p: Params)`.
macro_rules! kernels {
    ($($name:ident($params:ty) => $geometry:expr;)*) => {
        $(
            impl sealed::Sealed for $params {}

            impl KernelParams for $params {
                const ENTRY: &'static str = stringify!($name);

                #[inline]
                fn launch(&self) -> Launch {
                    let geometry: fn(&$params) -> Launch = $geometry;
                    geometry(self)
                }

                #[inline(always)]
                unsafe fn run<S: Simt>(self) {
                    // SAFETY: forwarded contract (see the trait method).
                    unsafe { kernels::$name::<S>(self) }
                }
            }
        )*

        /// Names of the kernel entry points (the exact PTX `.entry` names), one per
        /// [`KernelParams`] implementation.
        pub const ENTRY_POINTS: &[&str] = &[$(stringify!($name)),*];

        /// The nvptx entry points: `#[no_mangle]` makes the PTX `.entry` name the Rust
        /// name; each forwards its one by-value parameter struct to the kernel body
        /// instantiated for the GPU.
        #[cfg(target_arch = "nvptx64")]
        pub mod entry_points {
            use super::*;
            $(
                #[doc = concat!("The `", stringify!($name), "` kernel.")]
                ///
                /// # Safety
                /// See [`KernelParams::run`].
                #[no_mangle]
                pub unsafe extern "ptx-kernel" fn $name(p: $params) {
                    // SAFETY: forwarded contract.
                    unsafe { <$params as KernelParams>::run::<crate::device::Device>(p) }
                }
            )*
        }
    };
}

kernels! {
    index_k_store(IndexKStoreParams) => |p| store(p.n_tokens);
    kv_store(KvStoreParams) => |p| store(p.n_tokens);
    copy_pages(CopyPagesParams) => |p| copy_pages(p.n_pages);
    page_checksums(PageChecksumsParams) => |p| page_checksums(p.n_pages);
    indexer_logits(IndexerLogitsParams) => kernels::indexer_logits_launch;
    indexer_logits_fp4(IndexerLogitsFp4Params) => |p| kernels::indexer_logits_launch(&p.0);
    topk(TopkParams) => kernels::topk_launch;
    sparse_mla(SparseMlaParams) => kernels::sparse_mla_launch;
    sparse_mla_v4(SparseMlaV4Params) => kernels::sparse_mla_v4_launch;
    dense_matmul(DenseMatmulParams) => kernels::matmul_launch;
    dense_rms_norm(DenseRmsNormParams) => |p| kernels::row_launch(p.rows);
    dense_rope(DenseRopeParams) => |p| kernels::elementwise_launch(
        p.rows as u64 * p.heads as u64 * (p.rope_dim / 2) as u64
    );
    dense_swiglu(DenseSwiGluParams) => |p| kernels::elementwise_launch(
        p.rows as u64 * p.width as u64
    );
    dense_gather_rows(DenseGatherRowsParams) => |p| kernels::elementwise_launch(
        p.n_rows as u64 * p.width as u64
    );
    dense_add(DenseAddParams) => |p| kernels::elementwise_launch(p.rows as u64 * p.width as u64);
    dense_cast(DenseCastParams) => |p| kernels::elementwise_launch(
        p.rows as u64 * p.groups as u64 * p.width as u64
    );
    dense_argmax(DenseArgmaxParams) => |p| kernels::argmax_launch(p.rows);
    dense_gated_pool(DenseGatedPoolParams) => |p| kernels::elementwise_launch(
        p.entries as u64 * p.width as u64
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_points_are_the_params_entries() {
        assert_eq!(
            ENTRY_POINTS,
            [
                IndexKStoreParams::ENTRY,
                KvStoreParams::ENTRY,
                CopyPagesParams::ENTRY,
                PageChecksumsParams::ENTRY,
                IndexerLogitsParams::ENTRY,
                IndexerLogitsFp4Params::ENTRY,
                TopkParams::ENTRY,
                SparseMlaParams::ENTRY,
                SparseMlaV4Params::ENTRY,
                DenseMatmulParams::ENTRY,
                DenseRmsNormParams::ENTRY,
                DenseRopeParams::ENTRY,
                DenseSwiGluParams::ENTRY,
                DenseGatherRowsParams::ENTRY,
                DenseAddParams::ENTRY,
                DenseCastParams::ENTRY,
                DenseArgmaxParams::ENTRY,
                DenseGatedPoolParams::ENTRY,
            ]
        );
        let mut names = ENTRY_POINTS.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), 18, "entry names are unique");
    }
}
