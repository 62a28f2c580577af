//! The memory system: device and host page pools built from layout descriptors, a page
//! allocator with generations, pins and quarantine, the radix prefix tree, layer fences,
//! and the hierarchical cache that moves pages between tiers with checksums on every page
//! that crosses the boundary. The invariants and where each is enforced: `docs/cache.md`.
//!
//! Public surface: [`HiCache`] (lifecycle, eviction, accounting), [`Step`] /
//! [`ReadyToken`] / [`LayerGuard`] (the only way to a layer's bytes), [`Inbound`] (pages
//! written from elsewhere), and plain data ([`PageRef`], [`SlotRef`], [`Prefix`],
//! [`CacheStats`], [`CacheConfig`], [`CacheSpec`], [`Fault`]).
//!
//! One request's turn, as the serving engine runs it (several requests batch the same
//! way: `cache.step(&[a, b, c])`):
//!
//! ```
//! use std::sync::Arc;
//! use sparsekit_host::cache::{CacheConfig, CacheSpec, HiCache, SlotRef};
//! use sparsekit_host::layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout};
//! use sparsekit_host::{Backend, CpuBackend};
//!
//! # fn main() -> sparsekit_host::Result<()> {
//! let spec = CacheSpec::new(
//!     KvLayout::new(KvDtype::Bf16, 64, 16, 4)?,
//!     IndexKLayout::new(IndexKDtype::FP8, 32, 4)?,
//!     2,
//! )?;
//! let cache = HiCache::new(Arc::new(CpuBackend::new()), spec, CacheConfig::new(8, 32))?;
//! let tokens: Vec<u32> = (0..6).collect();
//! let prefix = cache.begin(7, &tokens)?; // matched (and loading) prefix: nothing yet
//! let mut pages = prefix.pages.clone();
//! pages.extend(cache.alloc(7, 2 - pages.len())?);
//! {
//!     let mut step = cache.step(&[7])?;
//!     for layer in 0..2 {
//!         // Waits (bounded) for this layer of every member's loads, then locks it.
//!         let mut guard = step.wait_layer(layer)?;
//!         let new: Vec<SlotRef> = (prefix.tokens..tokens.len())
//!             .map(|t| SlotRef { page: pages[t / 4], offset: (t % 4) as u32 })
//!             .collect();
//!         let b = cache.backend();
//!         guard.kv_store(&new, &b.upload(&vec![0x3f; new.len() * spec.kv.d_qk() * 2])?)?;
//!         let keys = b.upload(&vec![0x3f; new.len() * spec.index_k.head_dim() * 2])?;
//!         guard.index_k_store(&new, &keys)?;
//!         let (kv, index_k) = guard.views()?; // indexer_logits / sparse_mla read these
//!         assert_eq!(b.buffer_len(kv), spec.kv.buffer_bytes(8));
//!         assert_eq!(b.buffer_len(index_k), spec.index_k.buffer_bytes(8));
//!     }
//! }
//! cache.commit(7, &tokens, &pages)?; // the full page becomes reusable
//! cache.finish(7)?;
//! cache.leak_check()?;
//! # Ok(())
//! # }
//! ```
//!
//! What does not exist (each of these fails to compile):
//!
//! ```compile_fail
//! // No fence or token constructor: readiness comes only from a step's wait.
//! let t = sparsekit_host::cache::ReadyToken { cache: 1, step: 1, layer: 0 };
//! ```
//! ```compile_fail
//! // No raw access to a layer's buffers.
//! fn f(c: &sparsekit_host::cache::HiCache<sparsekit_host::CpuBackend>) {
//!     let _ = c.layer_mut(0);
//! }
//! ```
//! ```compile_fail
//! // No unfenced read path chosen at the call site.
//! fn f(c: &sparsekit_host::cache::HiCache<sparsekit_host::CpuBackend>) {
//!     let _ = c.device();
//! }
//! ```
//! ```compile_fail
//! // One guard per step at a time: no second lock while the first is held.
//! fn f(c: &sparsekit_host::cache::HiCache<sparsekit_host::CpuBackend>) {
//!     let mut s = c.step(&[1]).unwrap();
//!     let a = s.wait_layer(0).unwrap();
//!     let b = s.wait_layer(1).unwrap();
//!     drop((a, b));
//! }
//! ```

mod alloc;
mod check;
pub mod faults;
mod fence;
mod fence_core;
mod hicache;
mod inbound;
mod io;
mod late;
mod layer_store;
mod pool;
mod radix;
mod requests;
mod room;
mod state;
mod step;
mod types;
mod window;

pub use alloc::PageRef;
pub use faults::{Fault, Faults};
pub use fence::ReadyToken;
pub use hicache::{CacheConfig, CacheStats, HiCache, Prefix, RequestId, Room};
pub use inbound::Inbound;
pub use pool::{BufferKind, CacheSpec, ExtraPool, HostLayout, KINDS};
pub use step::{LayerGuard, ReadExtent, SlotRef, Step};
