//! The memory system: device and host page pools built from layout descriptors, a page
//! allocator with generations, the radix prefix tree, layer fences with ready tokens, and
//! the hierarchical cache that moves pages between tiers with checksums on every page
//! that crosses the boundary.

pub mod alloc;
pub mod faults;
pub mod fence;
pub mod hicache;
pub mod pool;
pub mod radix;

pub use alloc::{PageAllocator, PageRef};
pub use faults::{Fault, Faults};
pub use fence::{BufferView, LayerFence, LoadGroup, ReadyToken};
pub use hicache::{CacheConfig, CacheStats, HiCache, Prefix, RequestId};
pub use pool::{BufferKind, CacheSpec, DevicePool, HostLayout, HostPool, LayerBuffers};
pub use radix::{HostCopy, NodeId, RadixTree};
