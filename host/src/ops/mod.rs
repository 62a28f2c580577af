//! Op descriptors: the host-side half of every op.
//!
//! An op call is a descriptor (shapes, layout, and host metadata such as slot mappings,
//! page tables and key ranges) plus backend buffers for the bulk tensors. Descriptors
//! validate their metadata and the byte sizes of the buffers here, once, for every backend,
//! before anything is written: a rejected call leaves every buffer untouched.
//!
//! Tensor conventions (all little-endian, row-major, sizes in elements unless stated):
//! - `keys` (index_k_store): bf16 `[n_tokens, head_dim]`.
//! - `kv` (kv_store): bf16 `[n_tokens, nope_dim + rope_dim]`, latent first.
//! - `q` (indexer): bf16 `[n_rows, n_heads, head_dim]`; `weights`: f32 `[n_rows, n_heads]`.
//! - `logits`: f32 `[n_rows, row_stride]`, column = token position in the row's request.
//! - top-k output: i32 `[n_rows, k]`.
//! - `q` (sparse_mla): bf16 `[n_tokens, n_heads, d_qk]`; `indices`: i32 `[n_tokens, topk]`;
//!   `out`: bf16 `[n_tokens, n_heads, d_v]`; `lse`: f32 `[n_tokens, n_heads]`.
//! - `q` (sparse_mla_v4): bf16 `[n_tokens, n_heads, 512]`; per cache `indices`: i32
//!   `[n_tokens, topk]`; `out`: bf16 `[n_tokens, n_heads, 512]`; `lse`: f32
//!   `[n_tokens, n_heads]`.

//!
//! Sizes (checked arithmetic throughout: a product that overflows is an error, never a
//! wrapped size that happens to match a small buffer): every count of a call — tokens,
//! rows, heads, `k`, slots per token, page-table columns, pages copied — is at most
//! [`MAX_COUNT`] (`u32::MAX`), and a page at most
//! [`MAX_PAGE_BYTES`](crate::layout::MAX_PAGE_BYTES) bytes: the GPU kernels take them as
//! 32-bit parameters, and every backend enforces the same limits so that a call valid on
//! one backend is valid on all. Top-k slot outputs must fit in i32.
//!
//! One file per op, lining up with `cpu/` and `sparsekit_kernels::kernels`: `store`
//! (index_k_store, kv_store), `indexer_logits`, `topk`, `sparse_mla`, `pages`
//! (copy_pages, page_checksums); `batch` holds the ragged-batch metadata (page tables,
//! query ranges) they share.

mod batch;
mod indexer_logits;
mod pages;
mod sparse_mla;
mod sparse_mla_v4;
mod store;
mod topk;

use serde::Serialize;

use crate::error::{Error, Index, Result};

pub use batch::{decode_rows, PageTable, QueryRange};
pub use indexer_logits::IndexerLogits;
pub use pages::{CopyPages, PageChecksums, PagedRegion};
pub use sparse_mla::SparseMla;
pub use sparse_mla_v4::{SparseMlaV4, V4Cache, V4Pages, V4_MAX_HEADS};
pub use store::{IndexKStore, KvStore};
pub use topk::{ShortRows, Topk, TopkOutput};

/// The ops every backend implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    IndexKStore,
    KvStore,
    IndexerLogits,
    Topk,
    SparseMla,
    SparseMlaV4,
    CopyPages,
    PageChecksums,
}

impl Op {
    /// Every op, in suite order.
    pub const ALL: [Op; 8] = [
        Op::IndexKStore,
        Op::KvStore,
        Op::IndexerLogits,
        Op::Topk,
        Op::SparseMla,
        Op::SparseMlaV4,
        Op::CopyPages,
        Op::PageChecksums,
    ];

    /// snake_case name.
    pub fn name(&self) -> &'static str {
        match self {
            Op::IndexKStore => "index_k_store",
            Op::KvStore => "kv_store",
            Op::IndexerLogits => "indexer_logits",
            Op::Topk => "topk",
            Op::SparseMla => "sparse_mla",
            Op::SparseMlaV4 => "sparse_mla_v4",
            Op::CopyPages => "copy_pages",
            Op::PageChecksums => "page_checksums",
        }
    }
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Largest count of anything in one call (tokens, rows, heads, `k`, slots per token,
/// page-table columns, pages): the GPU kernels take counts as u32.
pub const MAX_COUNT: usize = u32::MAX as usize;

/// Checks that `count` is at most [`MAX_COUNT`].
pub fn check_count(what: &'static str, count: usize) -> Result<()> {
    if count > MAX_COUNT {
        return Err(Error::invalid(
            what,
            format!("{count} is above the limit of {MAX_COUNT} (32-bit kernel parameters)"),
        ));
    }
    Ok(())
}

/// The product of `factors` (a byte or element count), or an error naming `what` when it
/// overflows `usize`.
pub fn checked_size(what: &'static str, factors: &[usize]) -> Result<usize> {
    factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
        .ok_or_else(|| {
            let shown: Vec<String> = factors.iter().map(|f| f.to_string()).collect();
            Error::invalid(
                what,
                format!("size {} overflows the address space", shown.join(" × ")),
            )
        })
}

/// Checks that a buffer holds exactly `Π factors` bytes (checked product).
pub fn check_size(what: &'static str, factors: &[usize], actual: usize) -> Result<()> {
    check_bytes(what, checked_size(what, factors)?, actual)
}

/// Checks that a buffer holds exactly `expected` bytes.
pub fn check_bytes(what: &'static str, expected: usize, actual: usize) -> Result<()> {
    if expected != actual {
        return Err(Error::BufferSize {
            what,
            expected,
            actual,
        });
    }
    Ok(())
}

/// Checks that a host array holds exactly `expected` elements.
pub fn check_len(what: &'static str, expected: usize, actual: usize) -> Result<()> {
    if expected != actual {
        return Err(Error::Shape {
            what,
            expected,
            actual,
        });
    }
    Ok(())
}

/// Checks a slot mapping: each slot is `-1` (skip) or below `capacity`, and no slot is
/// written twice (reported at the earliest repeat, with its first occurrence).
pub fn check_slots(what: &'static str, slots: &[i64], capacity: usize) -> Result<()> {
    for (i, &s) in slots.iter().enumerate() {
        if s != -1 && (s < 0 || s as u64 >= capacity as u64) {
            return Err(Error::SlotOutOfRange {
                what,
                index: Index::Flat(i),
                slot: s,
                capacity,
            });
        }
    }
    let repeat = if capacity <= slots.len().saturating_mul(256).max(1 << 16) {
        first_repeat_bitset(slots, capacity)
    } else {
        first_repeat_sorted(slots)
    };
    match repeat {
        Some((first, second)) => Err(Error::DuplicateSlot {
            what,
            slot: slots[second],
            first,
            second,
        }),
        None => Ok(()),
    }
}

/// The earliest index whose slot appeared before, and that first appearance: one bit per
/// slot of the pool (`capacity` bits; for pools not much larger than the mapping). Slots
/// must be in range or -1.
fn first_repeat_bitset(slots: &[i64], capacity: usize) -> Option<(usize, usize)> {
    let mut seen = vec![0u64; capacity.div_ceil(64)];
    for (i, &s) in slots.iter().enumerate() {
        if s < 0 {
            continue;
        }
        let (w, b) = (s as usize / 64, 1u64 << (s as usize % 64));
        if seen[w] & b != 0 {
            let first = slots.iter().position(|&x| x == s).unwrap_or(i);
            return Some((first, i));
        }
        seen[w] |= b;
    }
    None
}

/// [`first_repeat_bitset`] by sorting the (slot, index) pairs: for a pool far larger than
/// the mapping.
fn first_repeat_sorted(slots: &[i64]) -> Option<(usize, usize)> {
    let mut order: Vec<(i64, usize)> = slots
        .iter()
        .enumerate()
        .filter(|(_, &s)| s >= 0)
        .map(|(i, &s)| (s, i))
        .collect();
    order.sort_unstable();
    order
        .windows(2)
        .filter(|w| w[0].0 == w[1].0)
        .map(|w| (w[0].1, w[1].1))
        // A slot's pairs come in index order: its first pair holds its first and second
        // appearances; the earliest second appearance wins.
        .min_by_key(|&(_, second)| second)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeats_agree_with_a_hash_map() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for _ in 0..200 {
            let cap = rng.gen_range(1..300usize);
            let n = rng.gen_range(0..40usize);
            let slots: Vec<i64> = (0..n)
                .map(|_| {
                    if rng.gen_bool(0.2) {
                        -1
                    } else {
                        rng.gen_range(0..cap as i64)
                    }
                })
                .collect();
            let mut seen = std::collections::HashMap::new();
            let want = slots.iter().enumerate().find_map(|(i, &s)| {
                (s >= 0)
                    .then(|| seen.insert(s, i).map(|first| (first, i)))
                    .flatten()
            });
            assert_eq!(first_repeat_bitset(&slots, cap), want, "{slots:?}");
            assert_eq!(first_repeat_sorted(&slots), want, "{slots:?}");
        }
    }

    #[test]
    fn slot_checks() {
        assert!(check_slots("s", &[0, 5, -1, 7, -1], 8).is_ok());
        assert!(matches!(
            check_slots("s", &[0, 8], 8),
            Err(Error::SlotOutOfRange {
                index: Index::Flat(1),
                slot: 8,
                ..
            })
        ));
        assert!(matches!(
            check_slots("s", &[-2], 8),
            Err(Error::SlotOutOfRange { slot: -2, .. })
        ));
        assert!(matches!(
            check_slots("s", &[3, 1, 3], 8),
            Err(Error::DuplicateSlot {
                first: 0,
                second: 2,
                ..
            })
        ));
    }
}
