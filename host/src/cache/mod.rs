//! The memory system: device and host page pools built from layout descriptors, a page
//! allocator with generations, pins and quarantine, the radix prefix tree, layer fences,
//! and the hierarchical cache that moves pages between tiers with checksums on every page
//! that crosses the boundary. The invariants and where each is enforced: `docs/cache.md`.
//!
//! Public surface: [`HiCache`] (lifecycle, eviction, accounting), [`Step`] /
//! [`ReadyToken`] / [`LayerGuard`] (the only way to a layer's bytes), [`Inbound`] (pages
//! written from elsewhere), and plain data ([`PageRef`], [`SlotRef`], [`Prefix`],
//! [`CacheStats`], [`CacheConfig`], [`CacheSpec`], [`Fault`]).

mod alloc;
pub mod faults;
mod fence;
mod fence_core;
mod hicache;
mod inbound;
mod io;
mod pool;
mod radix;
mod step;

pub use alloc::PageRef;
pub use faults::{Fault, Faults};
pub use fence::ReadyToken;
pub use hicache::{CacheConfig, CacheStats, HiCache, Prefix, RequestId};
pub use inbound::Inbound;
pub use pool::{BufferKind, CacheSpec, HostLayout};
pub use step::{LayerGuard, SlotRef, Step};
