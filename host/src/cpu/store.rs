//! CPU `index_k_store` and `kv_store`: quantize or copy new tokens into their cache pages
//! (every layout: fp8 / fp4 / bf16 index keys; bf16, fp8_ds_mla, model1_fp8, bf16_512 KV).

use half::bf16;
use rayon::prelude::*;

use sparsekit_kernels::fp8::bf16_to_f32;
use sparsekit_kernels::mx;

use super::isa::CpuIsa;
#[cfg(doc)]
use crate::dtype::amax_bf16;
use crate::dtype::{e4m3_encode, index_k_scale, kv_tile_scale};
use crate::layout::{
    IndexKDtype, IndexKLayout, KvDtype, KvLayout, PageLayout, FP4_GROUP, FP8_DS_MLA_TILE,
    MODEL1_SCALE_BYTES, MODEL1_TILE,
};
use crate::ops::{IndexKStore, KvStore};

/// [`IndexKStore`] on slices (validated by the caller) on the vector path `isa`: `keys`
/// bf16 `[slots.len(), head_dim]`, `cache` whole pages of the layout.
pub fn index_k_store(isa: CpuIsa, op: &IndexKStore<'_>, keys: &[bf16], cache: &mut [u8]) {
    let l = op.layout;
    scatter_by_page(cache, l.into(), op.slots, |page, tokens| {
        write_index_k_tokens(isa, &l, page, tokens, keys)
    })
}

crate::isa_dispatch! {
    /// Writes the index keys of `tokens` (`(offset in page, token)`, `keys` `[tokens,
    /// head_dim]`) into `page`; fp8 keys with their scales computed ahead
    /// ([`scales_ahead`]).
    fn write_index_k_tokens(
        layout: &IndexKLayout,
        page: &mut [u8],
        tokens: &[(usize, usize)],
        keys: &[bf16],
    ) = |ISA| {
        let d = layout.head_dim();
        let key = |t: usize| &keys[t * d..(t + 1) * d];
        match layout.dtype() {
            IndexKDtype::Fp8E4m3 { scale } => scales_ahead(
                tokens.len(),
                |i| index_k_scale(amax(key(tokens[i].1)), scale),
                |i, s| put_fp8_key(layout, page, tokens[i].0, key(tokens[i].1), s),
            ),
            _ => {
                for &(off, t) in tokens {
                    write_index_k_token_with(layout, page, off, key(t));
                }
            }
        }
    };
}

/// [`KvStore`] on slices (validated by the caller) on the vector path `isa`: `kv` bf16
/// `[slots.len(), d_qk]`, `cache` whole pages of the layout.
pub fn kv_store(isa: CpuIsa, op: &KvStore<'_>, kv: &[bf16], cache: &mut [u8]) {
    let l = op.layout;
    let d = l.d_qk();
    scatter_by_page(cache, l.into(), op.slots, |page, tokens| {
        for &(off, t) in tokens {
            write_kv_token_on(isa, &l, page, off, &kv[t * d..(t + 1) * d]);
        }
    })
}

/// Writes the index key of the token at `offset` of `page` (one whole page of bytes), on
/// the process's default vector path ([`CpuIsa::get`]).
pub fn write_index_k_token(layout: &IndexKLayout, page: &mut [u8], offset: usize, key: &[bf16]) {
    write_index_k_token_on(CpuIsa::get(), layout, page, offset, key)
}

crate::isa_dispatch! {
    /// [`write_index_k_token`] on the vector path `isa` (the whole key compiled for it).
    pub fn write_index_k_token_on(
        layout: &IndexKLayout,
        page: &mut [u8],
        offset: usize,
        key: &[bf16],
    ) = |ISA| write_index_k_token_with(layout, page, offset, key);
}

/// The body of [`write_index_k_token_on`], inlined into each path's compilation (so are
/// [`amax`], [`quantize`] and [`quantize_fp4_group`]).
#[inline(always)]
fn write_index_k_token_with(layout: &IndexKLayout, page: &mut [u8], offset: usize, key: &[bf16]) {
    let values = &mut page[layout.value_range(offset)];
    match layout.dtype() {
        IndexKDtype::Bf16 => put_bf16(values, key),
        IndexKDtype::Fp8E4m3 { scale } => {
            put_fp8_key(layout, page, offset, key, index_k_scale(amax(key), scale))
        }
        IndexKDtype::Fp4E2m1 => {
            let mut scales = [0u8; 64];
            for (g, (dst, group)) in values
                .chunks_exact_mut(FP4_GROUP / 2)
                .zip(key.chunks_exact(FP4_GROUP))
                .enumerate()
            {
                scales[g] = quantize_fp4_group(dst, group);
            }
            if let Some(r) = layout.scale_range(offset) {
                let n = r.len();
                page[r].copy_from_slice(&scales[..n]);
            }
        }
    }
}

/// Writes an fp8 index key quantised with scale `s`, and the scale, at `offset` of `page`.
#[inline(always)]
fn put_fp8_key(layout: &IndexKLayout, page: &mut [u8], offset: usize, key: &[bf16], s: f32) {
    quantize(&mut page[layout.value_range(offset)], key, s);
    if let Some(r) = layout.scale_range(offset) {
        page[r].copy_from_slice(&s.to_le_bytes());
    }
}

/// Packs one group of 32 bf16 into 16 bytes of e2m1 codes (even element in the low nibble)
/// and returns its ue8m0 scale byte (see [`sparsekit_kernels::mx`]): a group holding NaN
/// or ±inf gets scale `0xff` and codes 0.
#[inline(always)]
fn quantize_fp4_group(dst: &mut [u8], group: &[bf16]) -> u8 {
    let max_bits = group
        .iter()
        .fold(0u32, |m, x| mx::bf16_abs_bits_max(m, x.to_bits()));
    if mx::abs_bits_non_finite(max_bits) {
        dst.fill(0);
        return mx::UE8M0_NAN;
    }
    let s = mx::fp4_group_scale(bf16_to_f32(max_bits as u16));
    // All 32 codes first (one branch-free map that vectorises), then the nibble pairs.
    let mut codes = [0u8; FP4_GROUP];
    for (c, x) in codes.iter_mut().zip(group) {
        *c = mx::e2m1_encode(bf16_to_f32(x.to_bits()) / s);
    }
    for (d, pair) in dst.iter_mut().zip(codes.chunks_exact(2)) {
        *d = pair[0] | pair[1] << 4;
    }
    mx::ue8m0_encode(s)
}

/// Writes bf16 values as little-endian bytes.
fn put_bf16(dst: &mut [u8], xs: &[bf16]) {
    for (d, v) in dst.chunks_exact_mut(2).zip(xs) {
        d.copy_from_slice(&v.to_bits().to_le_bytes());
    }
}

/// Writes one KV token (`kv` = `[latent | rope]` bf16) at `offset` of `page` (one whole
/// page of bytes: its row, and for model1_fp8 its 8 bytes of the scale section), on the
/// process's default vector path ([`CpuIsa::get`]).
pub fn write_kv_token(layout: &KvLayout, page: &mut [u8], offset: usize, kv: &[bf16]) {
    write_kv_token_on(CpuIsa::get(), layout, page, offset, kv)
}

crate::isa_dispatch! {
    /// [`write_kv_token`] on the vector path `isa` (the whole token compiled for it).
    pub fn write_kv_token_on(layout: &KvLayout, page: &mut [u8], offset: usize, kv: &[bf16]) =
        |ISA| write_kv_token_with(layout, page, offset, kv);
}

/// The body of [`write_kv_token_on`], inlined into each path's compilation.
#[inline(always)]
fn write_kv_token_with(layout: &KvLayout, page: &mut [u8], offset: usize, kv: &[bf16]) {
    let (nope, rope) = kv.split_at(layout.nope_dim());
    let row = layout.token_range(offset);
    match layout.dtype() {
        KvDtype::Bf16 | KvDtype::Bf16x512 => {
            put_bf16(&mut page[row.clone()][layout.nope_range()], nope)
        }
        KvDtype::Fp8DsMla => {
            let token = &mut page[row.clone()];
            let at = layout.scales_range().start;
            for_each_tile::<FP8_DS_MLA_TILE>(nope, |t, tile, s| {
                quantize(
                    &mut token[t * FP8_DS_MLA_TILE..(t + 1) * FP8_DS_MLA_TILE],
                    tile,
                    s,
                );
                token[at + 4 * t..at + 4 * t + 4].copy_from_slice(&s.to_le_bytes());
            });
        }
        KvDtype::Model1Fp8 => {
            let mut scales = [0u8; MODEL1_SCALE_BYTES];
            let token = &mut page[row.clone()];
            for_each_tile::<MODEL1_TILE>(nope, |t, tile, s| {
                quantize(&mut token[t * MODEL1_TILE..(t + 1) * MODEL1_TILE], tile, s);
                scales[t] = mx::ue8m0_encode(s);
            });
            // The 7 scale bytes and the pad byte (0).
            let at = layout.tile_scale_range(offset).start;
            page[at..at + MODEL1_SCALE_BYTES].copy_from_slice(&scales);
        }
    }
    put_bf16(&mut page[row][layout.rope_range()], rope);
}

/// Calls `f(tile index, tile, tile scale)` for the tiles of `TILE` values of `nope` in
/// order (see [`scales_ahead`]).
#[inline(always)]
fn for_each_tile<const TILE: usize>(nope: &[bf16], mut f: impl FnMut(usize, &[bf16], f32)) {
    let tile = |i: usize| &nope[i * TILE..(i + 1) * TILE];
    scales_ahead(
        nope.len() / TILE,
        |i| kv_tile_scale(amax(tile(i))),
        |i, s| f(i, tile(i), s),
    )
}

/// Calls `f(i, scale(i))` for `i` in `0..n` in order, computing [`TILE_BLOCK`] scales
/// before their calls: the scales' reductions and divisions are independent chains the
/// CPU overlaps, where one item at a time would wait for each scale before quantising.
#[inline(always)]
fn scales_ahead(n: usize, scale: impl Fn(usize) -> f32, mut f: impl FnMut(usize, f32)) {
    for start in (0..n).step_by(TILE_BLOCK) {
        let end = (start + TILE_BLOCK).min(n);
        let mut scales = [0f32; TILE_BLOCK];
        for (i, s) in (start..end).zip(&mut scales) {
            *s = scale(i);
        }
        for (i, &s) in (start..end).zip(&scales) {
            f(i, s);
        }
    }
}

/// Scales [`scales_ahead`] computes together (model1_fp8's row: 448 / 64 tiles).
const TILE_BLOCK: usize = 8;

/// `amax` of bf16 values (NaN ignored), as [`amax_bf16`] but on the absolute-value bits:
/// non-negative floats order like their bits, so this is an integer max that vectorises
/// (the unsigned 16-bit max needs SSE4.1 or later: the baseline path runs it a value at a
/// time).
#[inline(always)]
fn amax(xs: &[bf16]) -> f32 {
    // NaN (above +inf in bits) counts as 0. 32 independent lanes, so the loop vectorises.
    let abs = |x: &bf16| {
        let b = x.to_bits() & 0x7fff;
        if b > 0x7f80 {
            0
        } else {
            b
        }
    };
    let mut lanes = [0u16; 32];
    let mut chunks = xs.chunks_exact(32);
    for c in chunks.by_ref() {
        for (m, x) in lanes.iter_mut().zip(c) {
            *m = (*m).max(abs(x));
        }
    }
    let m = chunks.remainder().iter().map(abs).fold(0, u16::max);
    bf16_to_f32(lanes.iter().copied().fold(m, u16::max))
}

/// `dst[i] = e4m3(src[i] / s)` (identical results on every vector path: the encoder is
/// branch-free integer/f32 arithmetic). When `s` is a power of two whose reciprocal is a
/// normal float (every KV tile scale, every ue8m0 index-K scale), `x / s` is computed as
/// `x · (1/s)`: both are the exact quotient rounded once, so the bytes are the same, and a
/// multiply costs a fraction of a division.
#[inline(always)]
fn quantize(dst: &mut [u8], src: &[bf16], s: f32) {
    let exp = (s.to_bits() >> 23) & 0xff;
    if s.to_bits() & 0x807f_ffff == 0 && (2..=253).contains(&exp) {
        let r = 1.0 / s;
        for (d, v) in dst.iter_mut().zip(src) {
            *d = e4m3_encode(bf16_to_f32(v.to_bits()) * r);
        }
    } else {
        for (d, v) in dst.iter_mut().zip(src) {
            *d = e4m3_encode(bf16_to_f32(v.to_bits()) / s);
        }
    }
}

/// The `(slot, token)` pairs of the tokens with a slot, grouped by page in ascending page
/// order (in any order within a page): a counting sort over the `pages` of the pool when
/// they are not many more than the tokens, else a sort.
fn by_page(layout: PageLayout, pages: usize, slots: &[i64]) -> Vec<(usize, usize)> {
    let page_of = |s: usize| layout.slot_addr(s).page;
    let mut order: Vec<(usize, usize)> = slots
        .iter()
        .enumerate()
        .filter(|(_, &s)| s >= 0)
        .map(|(t, &s)| (s as usize, t))
        .collect();
    if pages == 0 || pages > 4 * order.len() + 1024 {
        order.sort_unstable();
        return order;
    }
    let mut start = vec![0usize; pages + 1];
    for &(s, _) in &order {
        start[page_of(s).min(pages - 1) + 1] += 1;
    }
    for p in 0..pages {
        start[p + 1] += start[p];
    }
    let mut grouped = vec![(0usize, 0usize); order.len()];
    for &(s, t) in &order {
        let at = &mut start[page_of(s).min(pages - 1)];
        grouped[*at] = (s, t);
        *at += 1;
    }
    grouped
}

/// Applies `write(page_bytes, tokens)` once per page of `cache` (laid out as `layout`)
/// that tokens with a slot land in, in parallel over the pages; `tokens` holds their
/// `(offset in page, token)` pairs. Slots must be validated (in range, unique, or -1).
pub fn scatter_by_page(
    cache: &mut [u8],
    layout: PageLayout,
    slots: &[i64],
    write: impl Fn(&mut [u8], &[(usize, usize)]) + Sync,
) {
    let bytes_per_page = layout.bytes_per_page();
    let order = by_page(layout, cache.len() / bytes_per_page.max(1), slots);
    // Group the sorted (slot, token) pairs by page and hand each group its page.
    let mut groups: Vec<(usize, &[(usize, usize)])> = Vec::new();
    let mut rest = &order[..];
    while let Some(&(slot, _)) = rest.first() {
        let page = layout.slot_addr(slot).page;
        let n = rest.partition_point(|&(s, _)| layout.slot_addr(s).page == page);
        groups.push((page, &rest[..n]));
        rest = &rest[n..];
    }
    let mut pages: Vec<&mut [u8]> = Vec::with_capacity(groups.len());
    let mut tail = cache;
    let mut consumed = 0;
    for &(page, _) in &groups {
        let (_, from_page) = tail.split_at_mut((page - consumed) * bytes_per_page);
        let (this, after) = from_page.split_at_mut(bytes_per_page);
        pages.push(this);
        tail = after;
        consumed = page + 1;
    }
    pages.into_par_iter().zip(groups.par_iter()).for_each_init(
        Vec::new,
        |at, (page, (_, tokens))| {
            at.clear();
            at.extend(
                tokens
                    .iter()
                    .map(|&(slot, t)| (layout.slot_addr(slot).offset, t)),
            );
            write(page, at);
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reciprocal path gives the bytes of the division for every bf16 value (NaN,
    /// infinities, subnormals included) at power-of-two scales across the whole range, and
    /// other scales still divide.
    #[test]
    fn quantize_by_reciprocal_matches_division_bitwise() {
        let src: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        let mut scales: Vec<f32> = (-126..=127).map(|e| 2f32.powi(e)).collect();
        scales.extend([
            f32::INFINITY,
            1e-4,
            0.3,
            448.0 / 3.0,
            f32::MIN_POSITIVE / 4.0,
        ]);
        let mut dst = vec![0u8; src.len()];
        for &s in &scales {
            dst.fill(0xaa);
            quantize(&mut dst, &src, s);
            for (i, (&d, v)) in dst.iter().zip(&src).enumerate() {
                let want = e4m3_encode(bf16_to_f32(v.to_bits()) / s);
                assert_eq!(d, want, "bf16 bits {i:#06x}, scale {s:e}");
            }
        }
    }
}
