//! CPU page copies and page checksums (parallel over pages).
//!
//! The checksum is the one every backend computes ([`sparsekit_kernels::checksum`]): a
//! sum modulo 2^64 of one mixed term per 8-byte word, so lanes may sum their words apart
//! and add up at the end — the same digest, bit for bit, on every vector path.

use sparsekit_kernels::checksum::{finish, page_checksum, word_term, PHI};

use super::isa::{prefetch, CpuIsa, Isa};
#[cfg(target_arch = "x86_64")]
use super::raw;
use super::tasks::run_tasks;
use crate::ops::{CopyPages, PageChecksums};

/// Copies the pages. Inputs are validated by the caller (ids in range, unique
/// destinations, equal layouts).
pub fn copy_pages(op: &CopyPages<'_>, src: &[u8], dst: &mut [u8]) {
    let bytes = op.src.layout.bytes_per_page();
    // One &mut slice per destination page, taken by the copy that writes it.
    let mut slots: Vec<Option<&mut [u8]>> = dst[op.dst.offset..]
        .chunks_mut(op.dst.stride)
        .take(op.dst.num_pages)
        .map(|c| Some(&mut c[..bytes]))
        .collect();
    let work: Vec<(&mut [u8], usize)> = op
        .dst_ids
        .iter()
        .zip(op.src_ids)
        .filter_map(|(&d, &s)| slots[d as usize].take().map(|page| (page, s as usize)))
        .collect();
    run_tasks(work, |(page, s)| {
        page.copy_from_slice(&src[op.src.page_range(s)])
    });
}

/// Checksums the pages on the vector path `isa`. Inputs are validated by the caller.
///
/// Each task hashes a run of 8 pages and asks for the next page's first 2 KiB while it
/// hashes the current one (the pages are scattered over the pool, so the hardware's
/// stream prefetchers start cold on each); inside a page the vector loops ask 2 KiB ahead
/// themselves.
pub fn page_checksums(isa: CpuIsa, op: &PageChecksums<'_>, pool: &[u8], out: &mut [u64]) {
    let page = |id: i32| &pool[op.region.page_range(id as usize)];
    let tasks: Vec<_> = out
        .chunks_mut(PAGES_PER_TASK)
        .zip(op.ids.chunks(PAGES_PER_TASK))
        .collect();
    run_tasks(tasks, |(out, ids)| {
        for (j, (o, &id)) in out.iter_mut().zip(ids).enumerate() {
            if let Some(&next) = ids.get(j + 1) {
                let next = page(next);
                prefetch(&next[..next.len().min(PREFETCH_BYTES)]);
            }
            *o = checksum(isa, page(id));
        }
    });
}

/// Pages one [`page_checksums`] task hashes in order.
const PAGES_PER_TASK: usize = 8;

/// How far ahead (bytes) the checksum loops ask for a page's bytes. The bench's bf16
/// index-K pool of 2048 pages (151 MB): AVX2 14.3 → 9.0 ms, AVX-512 10.2 → 7.9 ms on an
/// Intel Xeon (2 threads), against the hardware prefetchers alone; 1 KiB and 4 KiB ahead
/// measured slower.
const PREFETCH_BYTES: usize = 2048;

/// One page's checksum on the vector path `isa` (equal to [`page_checksum`] on every path).
pub fn checksum(isa: CpuIsa, page: &[u8]) -> u64 {
    let (sum, done) = match isa.isa() {
        // SAFETY: a `CpuIsa` names only a path this CPU supports (AVX-512F and DQ here).
        #[cfg(target_arch = "x86_64")]
        Isa::Amx | Isa::Avx512Bf16 | Isa::Avx512 => unsafe { sum_avx512(page) },
        // SAFETY: as above (AVX2).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { sum_avx2(page) },
        _ => return page_checksum(page),
    };
    // The words the vectors did not cover (fewer than one vector's), zero-padded.
    let mut sum = sum;
    for (i, c) in ((done / 8) as u64..).zip(page[done..].chunks(8)) {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        sum = sum.wrapping_add(word_term(u64::from_le_bytes(w), i));
    }
    finish(sum, page.len() as u64)
}

/// The sum of the word terms of the first `page.len() / 64 · 64` bytes (returned), 8
/// words per vector: four vectors in flight (two left an Intel core waiting on
/// `vpmullq`'s latency), then vector by vector.
///
/// # Safety
/// The CPU must support AVX-512F and AVX-512DQ.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq")]
#[allow(
    clippy::incompatible_msrv,
    reason = "AVX-512 needs Rust 1.89, as the existing AVX-512 target features do"
)]
unsafe fn sum_avx512(page: &[u8]) -> (u64, usize) {
    use std::arch::x86_64::*;
    let mix = |z: __m512i| {
        let z = _mm512_xor_si512(z, _mm512_srli_epi64::<30>(z));
        let z = _mm512_mullo_epi64(z, _mm512_set1_epi64(0xBF58_476D_1CE4_E5B9_u64 as i64));
        let z = _mm512_xor_si512(z, _mm512_srli_epi64::<27>(z));
        let z = _mm512_mullo_epi64(z, _mm512_set1_epi64(0x94D0_49BB_1331_11EB_u64 as i64));
        _mm512_xor_si512(z, _mm512_srli_epi64::<31>(z))
    };
    let n = page.len() / 256 * 256;
    // Word index · φ for lanes 0..8, stepped by 8 words per vector.
    let phi = |j: u64| PHI.wrapping_mul(j) as i64;
    let mut ip = _mm512_setr_epi64(
        phi(0),
        phi(1),
        phi(2),
        phi(3),
        phi(4),
        phi(5),
        phi(6),
        phi(7),
    );
    let step = _mm512_set1_epi64(phi(8));
    let (mut a, mut b) = (_mm512_setzero_si512(), _mm512_setzero_si512());
    let (mut c, mut d) = (_mm512_setzero_si512(), _mm512_setzero_si512());
    let mut at = 0;
    while at < n {
        if let Some(ahead) = page.get(at + PREFETCH_BYTES..at + PREFETCH_BYTES + 256) {
            prefetch(ahead);
        }
        // SAFETY: `at + 256 ≤ n ≤ page.len()`.
        let (x, y, z, w) = unsafe {
            let p = page.as_ptr().add(at);
            (
                raw::read::<__m512i>(p.cast()),
                raw::read::<__m512i>(p.add(64).cast()),
                raw::read::<__m512i>(p.add(128).cast()),
                raw::read::<__m512i>(p.add(192).cast()),
            )
        };
        let ip1 = _mm512_add_epi64(ip, step);
        let ip2 = _mm512_add_epi64(ip1, step);
        let ip3 = _mm512_add_epi64(ip2, step);
        a = _mm512_add_epi64(a, mix(_mm512_xor_si512(x, ip)));
        b = _mm512_add_epi64(b, mix(_mm512_xor_si512(y, ip1)));
        c = _mm512_add_epi64(c, mix(_mm512_xor_si512(z, ip2)));
        d = _mm512_add_epi64(d, mix(_mm512_xor_si512(w, ip3)));
        ip = _mm512_add_epi64(ip3, step);
        at += 256;
    }
    // Whole vectors past the last group of four.
    while at + 64 <= page.len() {
        // SAFETY: `at + 64 ≤ page.len()`.
        let x = unsafe { raw::read::<__m512i>(page.as_ptr().add(at).cast()) };
        a = _mm512_add_epi64(a, mix(_mm512_xor_si512(x, ip)));
        ip = _mm512_add_epi64(ip, step);
        at += 64;
    }
    let sum = _mm512_add_epi64(_mm512_add_epi64(a, b), _mm512_add_epi64(c, d));
    (_mm512_reduce_add_epi64(sum) as u64, at)
}

/// The sum of the word terms of the first `page.len() / 32 · 32` bytes (returned): in
/// chunks of 18 words — 16 in four vectors of 4 (the 64-bit products from three 32-bit
/// ones: AVX2 has no 64-bit multiply; four independent mixes in flight, where two left an
/// Intel core waiting on the multiplies' latency: bf16 pages 17.3 → 13.1 ms) and
/// [`AVX2_SCALAR_WORDS`] on the scalar unit — then vector by vector.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_avx2(page: &[u8]) -> (u64, usize) {
    use std::arch::x86_64::*;
    // Low 64 bits of z · c, with c's halves given.
    let mul = |z: __m256i, c: __m256i, c_hi: __m256i| {
        let lo = _mm256_mul_epu32(z, c);
        let cross = _mm256_add_epi64(
            _mm256_mul_epu32(_mm256_srli_epi64::<32>(z), c),
            _mm256_mul_epu32(z, c_hi),
        );
        _mm256_add_epi64(lo, _mm256_slli_epi64::<32>(cross))
    };
    let (c1, c2) = (0xBF58_476D_1CE4_E5B9_u64, 0x94D0_49BB_1331_11EB_u64);
    let (m1, m1h) = (
        _mm256_set1_epi64x(c1 as i64),
        _mm256_set1_epi64x((c1 >> 32) as i64),
    );
    let (m2, m2h) = (
        _mm256_set1_epi64x(c2 as i64),
        _mm256_set1_epi64x((c2 >> 32) as i64),
    );
    let mix = |z: __m256i| {
        let z = _mm256_xor_si256(z, _mm256_srli_epi64::<30>(z));
        let z = mul(z, m1, m1h);
        let z = _mm256_xor_si256(z, _mm256_srli_epi64::<27>(z));
        let z = mul(z, m2, m2h);
        _mm256_xor_si256(z, _mm256_srli_epi64::<31>(z))
    };
    // Each chunk: words 0..16 in four vectors, words 16..CHUNK_WORDS by the scalar unit
    // (the 64-bit multiplies there run beside the vector ones).
    const CHUNK_WORDS: u64 = 16 + AVX2_SCALAR_WORDS as u64;
    let n = page.len() / (8 * CHUNK_WORDS as usize) * (8 * CHUNK_WORDS as usize);
    let phi = |j: u64| PHI.wrapping_mul(j) as i64;
    let mut ip = _mm256_setr_epi64x(phi(0), phi(1), phi(2), phi(3));
    // The next vector's word indices · φ: 4 words on.
    let four = _mm256_set1_epi64x(phi(4));
    let step = _mm256_set1_epi64x(phi(CHUNK_WORDS));
    let (mut a, mut b) = (_mm256_setzero_si256(), _mm256_setzero_si256());
    let (mut c, mut d) = (_mm256_setzero_si256(), _mm256_setzero_si256());
    let mut scalar = 0u64;
    let mut word = 16u64;
    let mut at = 0;
    while at < n {
        let chunk = 8 * CHUNK_WORDS as usize;
        if let Some(ahead) = page.get(at + PREFETCH_BYTES..at + PREFETCH_BYTES + chunk) {
            prefetch(ahead);
        }
        // SAFETY: `at + 8 · CHUNK_WORDS ≤ n ≤ page.len()`.
        let (x, y, z, w) = unsafe {
            let p = page.as_ptr().add(at);
            (
                raw::read::<__m256i>(p.cast()),
                raw::read::<__m256i>(p.add(32).cast()),
                raw::read::<__m256i>(p.add(64).cast()),
                raw::read::<__m256i>(p.add(96).cast()),
            )
        };
        let ip1 = _mm256_add_epi64(ip, four);
        let ip2 = _mm256_add_epi64(ip1, four);
        let ip3 = _mm256_add_epi64(ip2, four);
        a = _mm256_add_epi64(a, mix(_mm256_xor_si256(x, ip)));
        b = _mm256_add_epi64(b, mix(_mm256_xor_si256(y, ip1)));
        c = _mm256_add_epi64(c, mix(_mm256_xor_si256(z, ip2)));
        d = _mm256_add_epi64(d, mix(_mm256_xor_si256(w, ip3)));
        for (j, w) in page[at + 128..at + 128 + 8 * AVX2_SCALAR_WORDS]
            .chunks_exact(8)
            .enumerate()
        {
            let mut bytes = [0u8; 8];
            bytes.copy_from_slice(w);
            scalar = scalar.wrapping_add(word_term(u64::from_le_bytes(bytes), word + j as u64));
        }
        ip = _mm256_add_epi64(ip, step);
        word += CHUNK_WORDS;
        at += 8 * CHUNK_WORDS as usize;
    }
    // Whole vectors past the last chunk (`ip` holds their first word's indices · φ).
    while at + 32 <= page.len() {
        // SAFETY: `at + 32 ≤ page.len()`.
        let x = unsafe { raw::read::<__m256i>(page.as_ptr().add(at).cast()) };
        a = _mm256_add_epi64(a, mix(_mm256_xor_si256(x, ip)));
        ip = _mm256_add_epi64(ip, four);
        at += 32;
    }
    let mut lanes = [0u64; 4];
    let sum = _mm256_add_epi64(_mm256_add_epi64(a, b), _mm256_add_epi64(c, d));
    // SAFETY: 32 bytes written into a 32-byte array.
    unsafe { raw::write::<__m256i>(lanes.as_mut_ptr().cast(), sum) };
    (lanes.iter().fold(scalar, |s, &x| s.wrapping_add(x)), at)
}

/// Words of each AVX2 chunk the scalar unit mixes beside the vectors (2, with two vectors
/// a chunk: one core hashed 17.7 GB/s of a hot page instead of 14.0 on an AMD EPYC; 3 or
/// more measured slower, the scalar chain then being the longer; on an Intel Xeon 0 and
/// 2 measure the same with four vectors).
const AVX2_SCALAR_WORDS: usize = 2;

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Every vector path gives the reference digest, for every length around the vector
    /// widths (tails of every size) and random bytes.
    #[test]
    fn checksums_are_equal_on_every_path() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        let bytes: Vec<u8> = (0..9000).map(|_| rng.gen()).collect();
        for len in (0..300).chain([656, 1024, 8448, 8990]) {
            let off = rng.gen_range(0..8);
            let page = &bytes[off..off + len];
            let want = page_checksum(page);
            for isa in CpuIsa::available() {
                assert_eq!(checksum(isa, page), want, "len {len} {}", isa.isa());
            }
        }
    }
}
