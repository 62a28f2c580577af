//! sparsekit host side: everything between a caller and the kernels.
//!
//! - [`dtype`], [`dims`]: element codecs (bf16, e4m3, scales) and model dimensions;
//! - [`layout`]: the cache layout descriptors, the **only** place byte sizes, offsets and
//!   slot addresses are computed;
//! - [`ops`]: the op descriptors, which validate every call before anything is written
//!   (one file per op);
//! - [`backend`]: the [`Backend`] trait (buffers, ops, streams and events);
//! - [`cpu`]: the CPU backend (rayon, batch-invariant, vector paths chosen at run time);
//! - [`emu`]: the emulator backend (the GPU kernels of `sparsekit-kernels` on the host);
//! - [`launcher`]: the ops of every backend that runs the GPU kernels (emu here, cuda in
//!   the root package), written once over four primitives;
//! - [`cache`]: the cache tiers (page allocator, device and host pools, prefix tree, layer
//!   fences, the hierarchical cache and its integrity checks);
//! - [`error`]: the typed error.

pub mod audit;
pub mod backend;
pub mod cache;
pub mod cpu;
pub mod dims;
pub mod dtype;
pub mod emu;
pub mod error;
mod kernel_params;
pub mod launcher;
pub mod layout;
pub mod model_ops;
pub mod ops;
mod sync;

pub use audit::KernelAudit;
pub use backend::{Arithmetic, Backend, Event, KvInput, StreamKind};
pub use cpu::CpuBackend;
pub use dims::{ModelDims, V4Dims};
pub use emu::{EmuBackend, EmuTarget};
pub use error::{Error, ErrorKind, Result};
pub use layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout};
pub use model_ops::ModelOps;
