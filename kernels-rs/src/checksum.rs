//! The page checksum: a 64-bit digest of a page's bytes that every backend computes
//! identically, whatever its reduction order.
//!
//! The page is read as little-endian 8-byte words `w_i` (a final partial word is
//! zero-padded). Each word is mixed with its index, `mix(w_i ^ i·φ)` where `mix` is the
//! (bijective) SplitMix64 finalizer and φ = 0x9E3779B97F4A7C15, and the mixed words are
//! summed modulo 2^64 — associative and commutative, so a GPU block may reduce in any
//! order. The digest is `mix(sum ^ len)`. Any change of a single word changes the sum, and
//! the index term makes it sensitive to words moving.

/// Golden-ratio increment mixed with word indices.
pub const PHI: u64 = 0x9E37_79B9_7F4A_7C15;

/// The SplitMix64 finalizer (a bijection on u64).
#[inline(always)]
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Contribution of word `i`.
#[inline(always)]
pub fn word_term(word: u64, i: u64) -> u64 {
    mix(word ^ i.wrapping_mul(PHI))
}

/// Final digest from the sum of word terms and the page length in bytes.
#[inline(always)]
pub fn finish(sum: u64, len_bytes: u64) -> u64 {
    mix(sum ^ len_bytes)
}

/// Checksum of a whole page held in host memory.
pub fn page_checksum(page: &[u8]) -> u64 {
    let mut sum = 0u64;
    let mut chunks = page.chunks_exact(8);
    let mut i = 0u64;
    for c in chunks.by_ref() {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        sum = sum.wrapping_add(word_term(u64::from_le_bytes(w), i));
        i += 1;
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut w = [0u8; 8];
        w[..rest.len()].copy_from_slice(rest);
        sum = sum.wrapping_add(word_term(u64::from_le_bytes(w), i));
    }
    finish(sum, page.len() as u64)
}
