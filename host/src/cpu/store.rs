//! CPU `index_k_store` and `kv_store`: quantize or copy new tokens into their cache pages.

use half::bf16;
use rayon::prelude::*;

use sparsekit_kernels::fp8::bf16_to_f32;

use super::isa::CpuIsa;
#[cfg(doc)]
use crate::dtype::amax_bf16;
use crate::dtype::{e4m3_encode, index_k_scale, kv_tile_scale};
use crate::layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout, PageLayout, FP8_DS_MLA_TILE};

/// Writes the index key of the token at `offset` of `page` (one whole page of bytes), on
/// the process's default vector path ([`CpuIsa::get`]).
pub fn write_index_k_token(layout: &IndexKLayout, page: &mut [u8], offset: usize, key: &[bf16]) {
    write_index_k_token_on(CpuIsa::get(), layout, page, offset, key)
}

/// [`write_index_k_token`] on the vector path `isa`.
pub fn write_index_k_token_on(
    isa: CpuIsa,
    layout: &IndexKLayout,
    page: &mut [u8],
    offset: usize,
    key: &[bf16],
) {
    let values = &mut page[layout.value_range(offset)];
    match layout.dtype() {
        IndexKDtype::Bf16 => {
            for (dst, k) in values.chunks_exact_mut(2).zip(key) {
                dst.copy_from_slice(&k.to_bits().to_le_bytes());
            }
        }
        IndexKDtype::Fp8E4m3 { scale } => {
            let s = index_k_scale(amax(key), scale);
            quantize(isa, values, key, s);
            if let Some(r) = layout.scale_range(offset) {
                page[r].copy_from_slice(&s.to_le_bytes());
            }
        }
    }
}

/// Writes one KV token (`kv` = `[latent | rope]` bf16) into its `bytes_per_token` bytes, on
/// the process's default vector path ([`CpuIsa::get`]).
pub fn write_kv_token(layout: &KvLayout, token: &mut [u8], kv: &[bf16]) {
    write_kv_token_on(CpuIsa::get(), layout, token, kv)
}

/// [`write_kv_token`] on the vector path `isa`.
pub fn write_kv_token_on(isa: CpuIsa, layout: &KvLayout, token: &mut [u8], kv: &[bf16]) {
    let (nope, rope) = kv.split_at(layout.nope_dim());
    match layout.dtype() {
        KvDtype::Bf16 => {
            for (dst, v) in token[layout.nope_range()].chunks_exact_mut(2).zip(nope) {
                dst.copy_from_slice(&v.to_bits().to_le_bytes());
            }
        }
        KvDtype::Fp8DsMla => {
            let scales = layout.scales_range().start;
            for (t, tile) in nope.chunks_exact(FP8_DS_MLA_TILE).enumerate() {
                let s = kv_tile_scale(amax(tile));
                quantize(
                    isa,
                    &mut token[t * FP8_DS_MLA_TILE..(t + 1) * FP8_DS_MLA_TILE],
                    tile,
                    s,
                );
                token[scales + 4 * t..scales + 4 * t + 4].copy_from_slice(&s.to_le_bytes());
            }
        }
    }
    for (dst, v) in token[layout.rope_range()].chunks_exact_mut(2).zip(rope) {
        dst.copy_from_slice(&v.to_bits().to_le_bytes());
    }
}

/// `amax` of bf16 values (NaN ignored), as [`amax_bf16`] but on the absolute-value bits:
/// non-negative floats order like their bits, so this is an integer max that vectorises.
#[inline]
fn amax(xs: &[bf16]) -> f32 {
    let m = xs.iter().fold(0u16, |m, x| {
        let b = x.to_bits() & 0x7fff;
        m.max(if b > 0x7f80 { 0 } else { b })
    });
    bf16_to_f32(m)
}

crate::isa_dispatch! {
    /// `dst[i] = e4m3(src[i] / s)`, compiled for the vector path (identical results on
    /// every path: the encoder is branch-free integer/f32 arithmetic).
    fn quantize(dst: &mut [u8], src: &[bf16], s: f32) = |ISA| {
        for (d, v) in dst.iter_mut().zip(src) {
            *d = e4m3_encode(bf16_to_f32(v.to_bits()) / s);
        }
    };
}

/// Applies `write(page_bytes, offset_in_page, token)` for every token with a slot, in
/// parallel over the pages of `cache` (laid out as `layout`). Slots must be validated (in
/// range, unique, or -1).
pub fn scatter_by_page(
    cache: &mut [u8],
    layout: PageLayout,
    slots: &[i64],
    write: impl Fn(&mut [u8], usize, usize) + Sync,
) {
    let bytes_per_page = layout.bytes_per_page();
    let mut order: Vec<(usize, usize)> = slots
        .iter()
        .enumerate()
        .filter(|(_, &s)| s >= 0)
        .map(|(t, &s)| (s as usize, t))
        .collect();
    order.sort_unstable();
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
    pages
        .into_par_iter()
        .zip(groups.par_iter())
        .for_each(|(page, (_, tokens))| {
            for &(slot, t) in tokens.iter() {
                write(page, layout.slot_addr(slot).offset, t);
            }
        });
}
