//! `index_k_store` and `kv_store`: new tokens into their cache pages.

use super::{check_count, check_size, check_slots};
use crate::error::Result;
use crate::layout::{IndexKLayout, KvLayout};

/// `index_k_store`: quantize (fp8) or copy (bf16) `slots.len()` bf16 keys into a paged
/// index-K buffer at the given slots (`-1` = skip).
#[derive(Clone, Copy, Debug)]
pub struct IndexKStore<'a> {
    pub layout: IndexKLayout,
    pub slots: &'a [i64],
}

impl IndexKStore<'_> {
    /// Validates the call; returns the number of pages in the cache.
    pub fn validate(&self, keys_bytes: usize, cache_bytes: usize) -> Result<usize> {
        check_count("slots", self.slots.len())?;
        check_size(
            "keys",
            &[self.slots.len(), self.layout.head_dim(), 2],
            keys_bytes,
        )?;
        let pages = self.layout.pages_in("index-K cache", cache_bytes)?;
        check_slots("slots", self.slots, pages * self.layout.page_size())?;
        Ok(pages)
    }
}

/// `kv_store`: store `slots.len()` bf16 tokens (`[latent | rope]`) into a paged KV buffer.
#[derive(Clone, Copy, Debug)]
pub struct KvStore<'a> {
    pub layout: KvLayout,
    pub slots: &'a [i64],
}

impl KvStore<'_> {
    /// Validates the call; returns the number of pages in the cache.
    pub fn validate(&self, kv_bytes: usize, cache_bytes: usize) -> Result<usize> {
        check_count("slots", self.slots.len())?;
        check_size("kv", &[self.slots.len(), self.layout.d_qk(), 2], kv_bytes)?;
        let pages = self.layout.pages_in("KV cache", cache_bytes)?;
        check_slots("slots", self.slots, pages * self.layout.page_size())?;
        Ok(pages)
    }
}
