//! CPU `index_k_store` and `kv_store`: quantize or copy new tokens into their cache pages
//! (every layout: fp8 / fp4 / bf16 index keys; bf16, fp8_ds_mla, model1_fp8, bf16_512 KV).

use half::bf16;
use std::marker::PhantomData;
use std::ops::Range;

use sparsekit_kernels::fp8::bf16_to_f32;
use sparsekit_kernels::mx;

use super::isa::{prefetch_lines, CpuIsa, Isa};
#[cfg(target_arch = "x86_64")]
use super::raw;
use super::tasks::run_tasks;
#[cfg(doc)]
use crate::dtype::amax_bf16;
use crate::dtype::{e4m3_encode, index_k_scale, kv_tile_scale, ScaleFormat};
use crate::layout::{
    IndexKDtype, IndexKLayout, KvDtype, KvLayout, FP4_GROUP, FP8_DS_MLA_TILE, MODEL1_SCALE_BYTES,
    MODEL1_TILE,
};
use crate::ops::{IndexKStore, KvStore};
use crate::Result;

/// [`IndexKStore`] on slices on the vector path `isa`: `keys` bf16 `[slots.len(),
/// head_dim]`, `cache` whole pages of the layout. Validates the call first
/// ([`IndexKStore::validate`]: typed error, nothing written); then tokens are written in
/// their order, in parallel over runs of `TASK_TOKENS`.
pub fn index_k_store(
    isa: CpuIsa,
    op: &IndexKStore<'_>,
    keys: &[bf16],
    cache: &mut [u8],
) -> Result<()> {
    op.validate(std::mem::size_of_val(keys), cache.len())?;
    // SAFETY: validated just now.
    unsafe { index_k_store_validated(isa, op, keys, cache) };
    Ok(())
}

/// [`index_k_store`] after its validation.
///
/// # Safety
/// [`IndexKStore::validate`] accepted `op` with these buffers (the tokens are written in
/// parallel: a repeated slot would be a data race).
pub(crate) unsafe fn index_k_store_validated(
    isa: CpuIsa,
    op: &IndexKStore<'_>,
    keys: &[bf16],
    cache: &mut [u8],
) {
    let l = op.layout;
    // fp8 keys in a compiled function of their own: sharing one with the other kinds, the
    // fp8 division plans made fp4 keys 15% slower without touching their code.
    in_runs(
        cache,
        op.slots,
        keys,
        l.head_dim(),
        |spans, slots, keys| match l.dtype() {
            IndexKDtype::Fp8E4m3 { scale } => {
                write_fp8_index_k_tokens(isa, &l, scale, spans, slots, keys)
            }
            _ => write_index_k_tokens(isa, &l, spans, slots, keys),
        },
    );
}

/// Tokens per parallel task of the stores.
const TASK_TOKENS: usize = 64;

/// How many tokens ahead of the one it writes the KV store asks for the destination row's
/// cache lines ([`Spans::prefetch`]): the slots are scattered over the pool, so each row's
/// lines miss, and a write that misses waits for the line to be read first. On an AMD EPYC
/// Zen 1 guest, four tokens early stored fp8_ds_mla rows (656 bytes) 10% faster on one
/// thread and 20% on two; 2 and 8 tokens measured the same. The index-K entries (one or two
/// lines and a few scale bytes) gain nothing: fp4 keys stored 12% slower with the requests.
/// Eight since the Zen 4 guest of 2026-12-07 (`benches/RESULTS.md`): the same or up to 2%
/// faster than four when the host was quiet, and bf16 rows 19% faster in a stretch when the
/// host's memory was loaded (a bf16 row takes less time to write than a quantised one, so
/// it needs more tokens of warning).
const STORE_AHEAD: usize = 8;

/// The slot written [`STORE_AHEAD`] tokens after token `i` of `slots`, if any (not -1).
#[inline(always)]
fn slot_ahead(slots: &[i64], i: usize) -> Option<usize> {
    slots
        .get(i + STORE_AHEAD)
        .and_then(|&s| usize::try_from(s).ok())
}

/// Calls `write(spans, slots, rows)` for the runs of `TASK_TOKENS` tokens in parallel:
/// a run's slots and its rows of `input` (`[slots.len(), d]`), the cache shared as
/// [`Spans`].
fn in_runs(
    cache: &mut [u8],
    slots: &[i64],
    input: &[bf16],
    d: usize,
    write: impl Fn(&Spans<'_>, &[i64], &[bf16]) + Sync,
) {
    let spans = Spans::new(cache);
    let tasks: Vec<_> = slots
        .chunks(TASK_TOKENS)
        .zip(input.chunks(TASK_TOKENS * d.max(1)))
        .collect();
    run_tasks(tasks, |(slots, rows)| write(&spans, slots, rows));
}

crate::isa_dispatch! {
    /// Writes the fp8 index keys `keys` (`[slots.len(), head_dim]`, scales in `format`) at
    /// `slots` (validated: unique, in the pool, or -1), their scales and divisors computed
    /// ahead ([`scales_ahead`]).
    fn write_fp8_index_k_tokens(
        layout: &IndexKLayout,
        format: ScaleFormat,
        spans: &Spans<'_>,
        slots: &[i64],
        keys: &[bf16],
    ) = |ISA| {
        let d = layout.head_dim();
        scales_ahead(
            slots.len(),
            #[inline(always)]
            |i| index_k_scale(amax(row(keys, i, d)), format),
            #[inline(always)]
            |i, s| {
                if slots[i] >= 0 {
                    // SAFETY: validated slots are unique, and distinct slots' spans are
                    // disjoint.
                    let (values, scale) = unsafe { spans.index_k_entry(layout, slots[i] as usize) };
                    put_fp8_key(ISA, values, scale, row(keys, i, d), (s, Divisor::new(s)));
                }
            },
        )
    };
}

crate::isa_dispatch! {
    /// Writes the index keys `keys` (`[slots.len(), head_dim]`) at `slots` (validated:
    /// unique, in the pool, or -1), a token at a time (any layout; fp8 keys go through
    /// [`write_fp8_index_k_tokens`]).
    fn write_index_k_tokens(
        layout: &IndexKLayout,
        spans: &Spans<'_>,
        slots: &[i64],
        keys: &[bf16],
    ) = |ISA| {
        // The kind chosen once, outside the loop over tokens.
        match layout.dtype() {
            IndexKDtype::Fp4E2m1 => each_index_k_token(
                layout,
                spans,
                slots,
                keys,
                // A closure, not the function item: the item's `FnMut` shim is compiled
                // without the path's target features (30% slower).
                #[allow(clippy::redundant_closure, reason = "see above")]
                #[inline(always)]
                |values, scales, key| put_fp4_key(ISA, values, scales, key),
            ),
            _ => each_index_k_token(
                layout,
                spans,
                slots,
                keys,
                #[inline(always)]
                |values, scales, key| write_index_k_entry(ISA, layout, values, scales, key),
            ),
        }
    };
}

/// Calls `write(values, scales, key)` for each token whose slot is not -1, with the
/// slot's value and scale bytes.
#[inline(always)]
fn each_index_k_token(
    layout: &IndexKLayout,
    spans: &Spans<'_>,
    slots: &[i64],
    keys: &[bf16],
    mut write: impl FnMut(&mut [u8], &mut [u8], &[bf16]),
) {
    let d = layout.head_dim();
    for (i, &slot) in slots.iter().enumerate() {
        if slot >= 0 {
            // SAFETY: validated slots are unique, and distinct slots' spans are disjoint.
            let (values, scales) = unsafe { spans.index_k_entry(layout, slot as usize) };
            write(values, scales, row(keys, i, d));
        }
    }
}

/// [`KvStore`] on slices on the vector path `isa`: `kv` bf16 `[slots.len(), d_qk]`,
/// `cache` whole pages of the layout. Validates the call first ([`KvStore::validate`]:
/// typed error, nothing written); then tokens are written in their order, in parallel over
/// runs of `TASK_TOKENS`.
pub fn kv_store(isa: CpuIsa, op: &KvStore<'_>, kv: &[bf16], cache: &mut [u8]) -> Result<()> {
    op.validate(std::mem::size_of_val(kv), cache.len())?;
    // SAFETY: validated just now.
    unsafe { kv_store_validated(isa, op, kv, cache) };
    Ok(())
}

/// [`kv_store`] after its validation.
///
/// # Safety
/// [`KvStore::validate`] accepted `op` with these buffers (the tokens are written in
/// parallel: a repeated slot would be a data race).
pub(crate) unsafe fn kv_store_validated(
    isa: CpuIsa,
    op: &KvStore<'_>,
    kv: &[bf16],
    cache: &mut [u8],
) {
    let l = op.layout;
    in_runs(cache, op.slots, kv, l.d_qk(), |spans, slots, kv| {
        write_kv_tokens(isa, &l, spans, slots, kv)
    });
}

crate::isa_dispatch! {
    /// Writes the tokens `kv` (`[slots.len(), d_qk]`) at `slots` (validated: unique, in
    /// the pool, or -1).
    fn write_kv_tokens(layout: &KvLayout, spans: &Spans<'_>, slots: &[i64], kv: &[bf16]) =
        |ISA| {
            let d = layout.d_qk();
            for (i, &slot) in slots.iter().enumerate() {
                if let Some(ahead) = slot_ahead(slots, i) {
                    spans.prefetch(layout.slot_token_bytes(ahead));
                }
                if slot >= 0 {
                    // SAFETY: validated slots are unique, and distinct slots' spans are
                    // disjoint.
                    let (token, scales) = unsafe { spans.kv_token(layout, slot as usize) };
                    write_kv_row(ISA, layout, token, scales, row(kv, i, d));
                }
            }
        };
}

/// A cache buffer that several threads write at once, each token's bytes by the thread
/// that stores the token: [`Spans`] hands out the bytes of one slot at a time, and the
/// spans of distinct slots are disjoint in every layout, so with unique slots no two live
/// spans overlap.
struct Spans<'a> {
    ptr: *mut u8,
    len: usize,
    _cache: PhantomData<&'a mut [u8]>,
}

// SAFETY: a `Spans` is built from an exclusive borrow of the cache and hands out
// non-overlapping spans only (the callers' contract), so sharing it between threads
// shares no byte.
unsafe impl Sync for Spans<'_> {}

impl<'a> Spans<'a> {
    fn new(cache: &'a mut [u8]) -> Self {
        Spans {
            ptr: cache.as_mut_ptr(),
            len: cache.len(),
            _cache: PhantomData,
        }
    }

    /// The bytes `r` of the cache (bounds-checked).
    ///
    /// # Safety
    /// No other live reference overlaps `r`.
    #[allow(clippy::mut_from_ref, reason = "disjoint spans of an exclusive borrow")]
    #[inline(always)]
    unsafe fn span(&self, r: Range<usize>) -> &mut [u8] {
        assert!(
            r.start <= r.end && r.end <= self.len,
            "span {r:?} past the cache"
        );
        // SAFETY: in bounds (checked), not aliased (the caller's contract).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r.start), r.end - r.start) }
    }

    /// Asks for the cache lines that bytes `r` of the cache touch (the part inside the
    /// cache) into L1, to be written soon ([`prefetch_lines`]: a hint that makes no
    /// reference, so it may name bytes another thread writes).
    #[inline(always)]
    fn prefetch(&self, r: Range<usize>) {
        let end = r.end.min(self.len);
        if r.start < end {
            prefetch_lines::<true>(self.ptr.wrapping_add(r.start), end - r.start);
        }
    }

    /// The row and the scale-section bytes (model1_fp8's 8, else none) of KV `slot`.
    ///
    /// # Safety
    /// No other live span of this slot.
    #[allow(clippy::mut_from_ref, reason = "disjoint spans of an exclusive borrow")]
    #[inline(always)]
    unsafe fn kv_token(&self, layout: &KvLayout, slot: usize) -> (&mut [u8], &mut [u8]) {
        let row = layout.slot_token_bytes(slot);
        let scales = layout.slot_scale_entry_bytes(slot).unwrap_or(0..0);
        // SAFETY: a slot's row and scale bytes are disjoint, and disjoint from every other
        // slot's (the caller holds no other span of this slot).
        unsafe { (self.span(row), self.span(scales)) }
    }

    /// The value and scale bytes (none for bf16) of index-K `slot`.
    ///
    /// # Safety
    /// No other live span of this slot.
    #[allow(clippy::mut_from_ref, reason = "disjoint spans of an exclusive borrow")]
    #[inline(always)]
    unsafe fn index_k_entry(&self, layout: &IndexKLayout, slot: usize) -> (&mut [u8], &mut [u8]) {
        let values = layout.slot_value_bytes(slot);
        let scales = layout.slot_scale_bytes(slot).unwrap_or(0..0);
        // SAFETY: as in `kv_token`.
        unsafe { (self.span(values), self.span(scales)) }
    }
}

/// Two disjoint byte ranges of `page` as separate slices (`b` may be empty).
fn two_spans(page: &mut [u8], a: Range<usize>, b: Range<usize>) -> (&mut [u8], &mut [u8]) {
    if b.is_empty() {
        return (&mut page[a], &mut []);
    }
    if a.end <= b.start {
        let (lo, hi) = page.split_at_mut(b.start);
        (&mut lo[a], &mut hi[..b.end - b.start])
    } else {
        debug_assert!(b.end <= a.start, "overlapping spans {a:?} {b:?}");
        let (lo, hi) = page.split_at_mut(a.start);
        (&mut hi[..a.end - a.start], &mut lo[b])
    }
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
    ) = |ISA| {
        let scales = layout.scale_range(offset).unwrap_or(0..0);
        let (values, scales) = two_spans(page, layout.value_range(offset), scales);
        write_index_k_entry(ISA, layout, values, scales, key)
    };
}

/// Writes one index key into its value bytes and scale bytes (none for bf16); inlined
/// into each path's compilation (so are [`amax`], [`quantize`] and
/// [`encode_fp4_group`]).
#[inline(always)]
fn write_index_k_entry(
    isa: CpuIsa,
    layout: &IndexKLayout,
    values: &mut [u8],
    scales: &mut [u8],
    key: &[bf16],
) {
    match layout.dtype() {
        IndexKDtype::Bf16 => put_bf16(values, key),
        IndexKDtype::Fp8E4m3 { scale } => {
            let s = index_k_scale(amax(key), scale);
            put_fp8_key(isa, values, scales, key, (s, Divisor::new(s)))
        }
        IndexKDtype::Fp4E2m1 => put_fp4_key(isa, values, scales, key),
    }
}

/// Writes an fp4 index key's codes into `values` and its groups' ue8m0 scales into
/// `scales`, a group at a time (finding every group's largest magnitude first was slower).
#[inline(always)]
fn put_fp4_key(isa: CpuIsa, values: &mut [u8], scales: &mut [u8], key: &[bf16]) {
    for ((dst, group), sc) in values
        .chunks_exact_mut(FP4_GROUP / 2)
        .zip(key.chunks_exact(FP4_GROUP))
        .zip(scales.iter_mut())
    {
        *sc = encode_fp4_group(isa, dst, group, fp4_group_max(group));
    }
}

/// Writes an fp8 index key quantised with scale `s` (divided as `divisor`, its
/// [`Divisor`]) into `values`, and the scale (f32, little-endian) into `scale`.
#[inline(always)]
fn put_fp8_key(
    isa: CpuIsa,
    values: &mut [u8],
    scale: &mut [u8],
    key: &[bf16],
    (s, divisor): (f32, Divisor),
) {
    divisor.quantize(isa, values, key);
    scale.copy_from_slice(&s.to_le_bytes());
}

/// The largest absolute-value pattern of a group ([`mx::bf16_abs_bits_max`]).
#[inline(always)]
fn fp4_group_max(group: &[bf16]) -> u32 {
    group.iter().fold(
        0u32,
        #[inline(always)]
        |m, x| mx::bf16_abs_bits_max(m, x.to_bits()),
    )
}

/// Packs one group of 32 bf16, whose [`fp4_group_max`] is `max_bits`, into 16 bytes of
/// e2m1 codes (even element in the low nibble) and returns its ue8m0 scale byte (see
/// [`sparsekit_kernels::mx`]): a group holding NaN or ±inf gets scale `0xff` and codes 0.
/// Identical bytes on every path (the vector paths in byte lanes, [`fp4_codes_avx2`]; the
/// scalar path, and a scale outside the byte lanes' range, in the portable 16-bit map).
#[inline(always)]
fn encode_fp4_group(isa: CpuIsa, dst: &mut [u8], group: &[bf16], max_bits: u32) -> u8 {
    if mx::abs_bits_non_finite(max_bits) {
        dst.fill(0);
        return mx::UE8M0_NAN;
    }
    let scale_byte = fp4_scale_byte(max_bits);
    let s = f32::from_bits(u32::from(scale_byte) << 23);
    // All 32 codes first (one branch-free map that vectorises), then the nibble pairs.
    let mut codes = [0u16; FP4_GROUP];
    let k = ((s.to_bits() >> 23) & 0xff) as i32 - 127;
    #[cfg(target_arch = "x86_64")]
    if isa.isa() != Isa::Scalar && (-124..=125).contains(&k) {
        // SAFETY: a `CpuIsa` names only a path this CPU supports, and every vector path
        // includes AVX2 (`Isa::supported`).
        unsafe { fp4_codes_avx2(dst, group, k) };
        return scale_byte;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    if (-124..=125).contains(&k) {
        // `|x| / 2^k` is, on the bf16 patterns, `|x|`'s pattern minus `k` in the exponent
        // field (exact for normal values; a pattern below zero is a value too small for any
        // code): at most 6's pattern, as the group's largest magnitude divided by its scale
        // is at most 6, and at least −125·128, so it fits an i16. From 1.0 up the codes are
        // e2m1's normal ones: the pattern rounded at bit 6 to nearest even (the carry runs
        // into the exponent) and rebiased in one add, at most 7; below 1.0 two thresholds
        // (0.25 exclusive, 0.75 inclusive: ties to the even code). Signed 16-bit
        // operations and one select, so the map vectorises over 16-bit lanes (32 values
        // per AVX-512 vector).
        let k7 = (k << 7) as i16;
        for (c, x) in codes.iter_mut().zip(group) {
            let h = x.to_bits();
            let v = ((h & 0x7fff) as i16).wrapping_sub(k7);
            let lsb = (v >> 6) & 1;
            let normal = (v.wrapping_add(0x1f + lsb).wrapping_sub(252 << 6) >> 6).min(7);
            let small = (v > 0x3e80) as i16 + (v > 0x3f40 - 1) as i16;
            let mag = if v >= 0x3f80 { normal } else { small };
            *c = (h >> 12) & 8 | mag as u16;
        }
    } else {
        for (c, x) in codes.iter_mut().zip(group) {
            *c = u16::from(mx::e2m1_encode(bf16_to_f32(x.to_bits()) / s));
        }
    }
    // The nibble pairs from the codes' 32-bit words (a pair in each): vector lanes of 32
    // bits, where pairs of 16-bit lanes took LLVM a dozen shuffles.
    let words: [u32; FP4_GROUP / 2] = bytemuck::cast(codes);
    for (d, w) in dst.iter_mut().zip(words) {
        let (even, odd) = if cfg!(target_endian = "little") {
            (w & 0xffff, w >> 16)
        } else {
            (w >> 16, w & 0xffff)
        };
        *d = (even | odd << 4) as u8;
    }
    scale_byte
}

/// The fields of 32 bf16 values in AVX2 byte lanes: `[mantissa (7 bits), biased exponent,
/// sign]`, the sign byte the pattern's signed saturation (its top bit the sign). Bytes in
/// the order 0–7, 16–23, 8–15, 24–31 (the packs work per 128-bit lane).
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn bf16_fields_avx2(src: &[bf16]) -> [std::arch::x86_64::__m256i; 3] {
    use std::arch::x86_64::*;
    assert!(src.len() >= 32, "32 values");
    // SAFETY: 32 bf16 (64 bytes) read: in bounds (asserted).
    let (h0, h1) = unsafe {
        (
            raw::read::<__m256i>(src.as_ptr().cast()),
            raw::read::<__m256i>(src.as_ptr().add(16).cast()),
        )
    };
    let low7 = _mm256_set1_epi16(0x7f);
    let low8 = _mm256_set1_epi16(0xff);
    let m = _mm256_packus_epi16(_mm256_and_si256(h0, low7), _mm256_and_si256(h1, low7));
    let e = _mm256_packus_epi16(
        _mm256_and_si256(_mm256_srli_epi16::<7>(h0), low8),
        _mm256_and_si256(_mm256_srli_epi16::<7>(h1), low8),
    );
    [m, e, _mm256_packs_epi16(h0, h1)]
}

/// The packed e2m1 codes of one finite group of 32 bf16 (16 bytes into `dst`) divided by
/// its scale `2^k` (`k` in `-124..=125`), in AVX2 byte lanes: 32 values a vector where the
/// portable map's 16-bit lanes take 16. The AVX-512 paths use it too: there the 16-bit map
/// fills a vector as well, but on a Zen 4 the whole fp4 store ran 16% faster with this
/// encoder (on a Xeon the two measured the same; `benches/RESULTS.md`).
///
/// The quotient's biased exponent is `E − k` (its mantissa `m` the value's 7 bits), and
/// e2m1's code is a function of the binade `D = clamp(E − k − 124, 0, 6)` and two
/// thresholds on `m` (ties to the even code): `D = 0` (below 0.25) 0; `D = 1` (`[0.25,
/// 0.5)`) `m > 0`; `D = 2` (`[0.5, 1)`) `1 + (m ≥ 64)`; `D = 3` and `4` (`[1, 2)` and `[2,
/// 4)`) `2` and `4` plus `(m > 32) + (m ≥ 96)`; `D = 5` (`[4, 8)`) `6 + (m > 32)`; `D = 6` (at
/// least 8: not reached, the largest magnitude divided by the scale is at most 6) 7.
/// Looked up with three byte shuffles by `D`. A subnormal value has `E = 0`, so `D = 0`:
/// for `k ≥ −124` it is below 0.25 of the scale.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn fp4_codes_avx2(dst: &mut [u8], group: &[bf16], k: i32) {
    use std::arch::x86_64::*;
    assert!(
        dst.len() >= FP4_GROUP / 2 && (-124..=125).contains(&k),
        "one finite group of 32 values with its scale exponent"
    );
    // SAFETY: AVX2 (this function's contract).
    let [m, e, sign] = unsafe { bf16_fields_avx2(group) };
    let d = _mm256_min_epu8(
        _mm256_subs_epu8(e, _mm256_set1_epi8((k + 124) as i8)),
        _mm256_set1_epi8(6),
    );
    let table = |bytes: [u8; 8]| _mm256_set1_epi64x(i64::from_le_bytes(bytes));
    let base = _mm256_shuffle_epi8(table([0, 0, 1, 2, 4, 6, 7, 7]), d);
    let above = _mm256_shuffle_epi8(table([127, 0, 63, 32, 32, 32, 127, 127]), d);
    let mag = _mm256_sub_epi8(base, _mm256_cmpgt_epi8(m, above));
    let above = _mm256_shuffle_epi8(table([127, 127, 127, 95, 95, 127, 127, 127]), d);
    let mag = _mm256_sub_epi8(mag, _mm256_cmpgt_epi8(m, above));
    // The sign to bit 3 (a 16-bit shift: the bits it moves across bytes are masked off).
    let code = _mm256_or_si256(
        mag,
        _mm256_and_si256(_mm256_srli_epi16::<4>(sign), _mm256_set1_epi8(8)),
    );
    // Each 16-bit lane holds a pair (even code low): its byte is `(w | w >> 4) & 0xff`.
    let pairs = _mm256_and_si256(
        _mm256_or_si256(code, _mm256_srli_epi16::<4>(code)),
        _mm256_set1_epi16(0xff),
    );
    // Per 128-bit lane the packed pairs of values 0–7 and 16–23 (lane 0) or 8–15 and
    // 24–31 (lane 1), as dwords 0 and 1 of each lane: put in order 0, 4, 1, 5.
    let packed = _mm256_packus_epi16(pairs, _mm256_setzero_si256());
    let packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 3, 6, 7));
    // SAFETY: 16 bytes written: in bounds (asserted).
    unsafe { raw::write::<__m128i>(dst.as_mut_ptr().cast(), _mm256_castsi256_si128(packed)) };
}

/// The ue8m0 byte of [`mx::fp4_group_scale`] of a group whose [`fp4_group_max`] is the
/// finite pattern `max_bits`, on the bits: for `amax = (1 + m/128)·2^(E−127)`, `amax / 6 =
/// ((1 + m/128) / 1.5)·2^(E−129)` and the fraction is at most 1 exactly when `m ≤ 64`
/// (f32's rounding of the quotient never crosses a power of two: the fractions nearest 1
/// are 191/192 and 193/192), so the scale is `2^(E − 129 + (m > 64))`, floored at `2^-126`
/// (byte 1; subnormal maxima too). No division on the group's dependency chain.
#[inline(always)]
fn fp4_scale_byte(max_bits: u32) -> u8 {
    let (e, m) = (max_bits >> 7, max_bits & 0x7f);
    (e + u32::from(m > 64)).saturating_sub(2).max(1) as u8
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
        |ISA| {
            let scales = layout.scale_entry_range(offset).unwrap_or(0..0);
            let (token, scales) = two_spans(page, layout.token_range(offset), scales);
            write_kv_row(ISA, layout, token, scales, kv)
        };
}

/// Writes one KV token into its row and (model1_fp8) its 8 scale-section bytes: the 7
/// ue8m0 tile scales and the pad byte (0). Inlined into each path's compilation.
#[inline(always)]
fn write_kv_row(isa: CpuIsa, layout: &KvLayout, token: &mut [u8], scales: &mut [u8], kv: &[bf16]) {
    let (nope, rope) = kv.split_at(layout.nope_dim());
    match layout.dtype() {
        KvDtype::Bf16 | KvDtype::Bf16x512 => put_bf16(&mut token[layout.nope_range()], nope),
        KvDtype::Fp8DsMla => {
            let at = layout.scales_range().start;
            for_each_tile::<FP8_DS_MLA_TILE>(
                nope,
                #[inline(always)]
                |t, tile, s| {
                    quantize(
                        isa,
                        &mut token[t * FP8_DS_MLA_TILE..(t + 1) * FP8_DS_MLA_TILE],
                        tile,
                        s,
                    );
                    token[at + 4 * t..at + 4 * t + 4].copy_from_slice(&s.to_le_bytes());
                },
            );
        }
        KvDtype::Model1Fp8 => {
            let mut bytes = [0u8; MODEL1_SCALE_BYTES];
            for_each_tile::<MODEL1_TILE>(
                nope,
                #[inline(always)]
                |t, tile, s| {
                    quantize(
                        isa,
                        &mut token[t * MODEL1_TILE..(t + 1) * MODEL1_TILE],
                        tile,
                        s,
                    );
                    bytes[t] = mx::ue8m0_encode(s);
                },
            );
            scales.copy_from_slice(&bytes);
        }
    }
    put_bf16(&mut token[layout.rope_range()], rope);
}

/// Calls `f(tile index, tile, tile scale)` for the tiles of `TILE` values of `nope` in
/// order (see [`scales_ahead`]).
#[inline(always)]
fn for_each_tile<const TILE: usize>(nope: &[bf16], mut f: impl FnMut(usize, &[bf16], f32)) {
    scales_ahead(
        nope.len() / TILE,
        #[inline(always)]
        |i| kv_tile_scale(amax(row(nope, i, TILE))),
        #[inline(always)]
        |i, s| f(i, row(nope, i, TILE), s),
    )
}

/// Row `i` of `xs` in rows of `n` values.
#[inline(always)]
fn row<T>(xs: &[T], i: usize, n: usize) -> &[T] {
    &xs[i * n..(i + 1) * n]
}

/// Calls `f(i, scale(i))` for `i` in `0..n` in order, computing [`TILE_BLOCK`] scales
/// before their calls: the scales' reductions and divisions are independent chains the
/// CPU overlaps, where one item at a time would wait for each scale before quantising.
#[inline(always)]
fn scales_ahead<S: Copy + Default>(
    n: usize,
    scale: impl Fn(usize) -> S,
    mut f: impl FnMut(usize, S),
) {
    for start in (0..n).step_by(TILE_BLOCK) {
        let end = (start + TILE_BLOCK).min(n);
        let mut scales = [S::default(); TILE_BLOCK];
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
    #[inline(always)]
    fn abs(x: &bf16) -> u16 {
        let b = x.to_bits() & 0x7fff;
        if b > 0x7f80 {
            0
        } else {
            b
        }
    }
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

/// `dst[i] = e4m3(src[i] / s)` (identical results on every vector path: the encoders are
/// branch-free integer/f32 arithmetic); see [`Divisor`].
#[inline(always)]
fn quantize(isa: CpuIsa, dst: &mut [u8], src: &[bf16], s: f32) {
    Divisor::new(s).quantize(isa, dst, src);
}

/// How values are divided by one scale `s` and encoded as e4m3: found once per scale (a
/// store computes a block of them ahead, [`scales_ahead`]), then used for its values.
#[derive(Clone, Copy, Debug, Default)]
enum Divisor {
    /// `s = 2^k` with a normal reciprocal (every KV tile scale, every ue8m0 index-K
    /// scale): the quotient is exact and found on the bf16 bits ([`quantize_pow2`]).
    Pow2(i32),
    /// Other scales with a [`DivisionPlan`]: integer steps on the bf16 bits, the blocks
    /// the plan leaves undecided divided in f32.
    Plan(f32, DivisionPlan),
    /// Each quotient `x / s` computed in f32 (scales outside the plans' range).
    Exact(f32),
    /// No scale (the unused entries of a block computed ahead).
    #[default]
    Unused,
}

impl Divisor {
    /// How values are divided by `s`.
    #[inline(always)]
    fn new(s: f32) -> Self {
        let exp = (s.to_bits() >> 23) & 0xff;
        if s.to_bits() & 0x807f_ffff == 0 && (POW2_EXP_MIN..=253).contains(&exp) {
            return Divisor::Pow2(exp as i32 - 127);
        }
        match DivisionPlan::new(s) {
            Some(plan) => Divisor::Plan(s, plan),
            None => Divisor::Exact(s),
        }
    }

    /// `dst[i] = e4m3(src[i] / s)`.
    #[inline(always)]
    fn quantize(self, isa: CpuIsa, dst: &mut [u8], src: &[bf16]) {
        match self {
            Divisor::Pow2(k) => quantize_pow2(dst, src, k),
            Divisor::Plan(s, plan) => plan.quantize(isa, dst, src, s),
            Divisor::Exact(s) => divide_exactly(dst, src, s),
            Divisor::Unused => {}
        }
    }
}

/// `dst[i] = e4m3(src[i] / s)`, each quotient computed in f32.
#[inline(always)]
fn divide_exactly(dst: &mut [u8], src: &[bf16], s: f32) {
    for (d, v) in dst.iter_mut().zip(src) {
        *d = encode_lanes(bf16_to_f32(v.to_bits()) / s);
    }
}

/// The division by one scale `s` as integer steps on bf16 patterns, with no division per
/// value.
///
/// For a normal bf16 `x = (1 + m/128)·2^(E−127)` and `s = M·2^(e−127)` (`M` in `[1, 2)`),
/// the f32 quotient is `RN((1 + m/128) / M)·2^(E−e)` whenever it is a normal f32, and the
/// e4m3 rounding of a normal value looks at mantissa bits only, so the code is
/// `R(m) + 8·(E − e) − 960`, where `R(m)` is the rounded 23-bit pattern of
/// `RN((1 + m/128) / M)` shifted by 20 (`e4m3_encode`'s normal branch before its rebias).
/// `R` is non-decreasing in `m` and its 128 values span at most 8 steps (a factor below 2
/// holds at most 8 of e4m3's rounding points): `R(m) = R(0) + #{j : m ≥ t_j}` for eight
/// thresholds, found per scale without dividing per `m` ([`DivisionPlan::new`]). A value's
/// code is then its exponent field and a [`StepTable`] lookup of its mantissa.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct DivisionPlan {
    /// `R(m) − R(0) + (R(0) mod 8)` by the mantissa's top three bits.
    table: StepTable,
    /// The bf16 exponent field at which the clamped difference `D` starts (see
    /// [`DivisionPlan::encode_block`]).
    e_base: u8,
}

/// The steps of `R` (see [`DivisionPlan`]) by bucket of 16 mantissas `h = m >> 4`, in three
/// 8-byte tables that one byte shuffle each looks up for a whole vector. `R`'s steps are at
/// least 8 mantissas apart — the quotient `(1 + m/128) / M` grows by `1/(128·M)` per
/// mantissa and e4m3 rounds it in steps of `1/16` below 1 and `1/8` above, i.e. every `8·M`
/// or `16·M` mantissas, `M ≥ 1` — so a bucket holds at most two of them, and `F(m) =
/// count[h] + (m > first[h]) + (m > second[h])`. Aligned so that each table is one 8-byte
/// load.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C, align(8))]
struct StepTable {
    /// `(R(0) mod 8)` plus the steps at or below the bucket's first mantissa `16·h`.
    count: [u8; 8],
    /// The bucket's first step inside it, as the mantissa it lies above (`127`: none).
    first: [i8; 8],
    /// Its second step inside it, likewise.
    second: [i8; 8],
}

impl StepTable {
    /// The table of the steps `steps` (`t_j − 1`, see [`PlanShape::steps`]) at offset
    /// `offset`, or `None` if a bucket held three (not for any quotient of a bf16
    /// mantissa: see above).
    const fn new(steps: &[i8; 8], offset: u8) -> Option<Self> {
        let mut table = StepTable {
            count: [offset; 8],
            first: [127; 8],
            second: [127; 8],
        };
        let mut h = 0;
        while h < 8 {
            let lo = 16 * h as i16;
            let mut j = 0;
            while j < 8 {
                // The step is taken from mantissa `t = steps[j] + 1` on.
                let t = steps[j] as i16 + 1;
                if t <= lo {
                    table.count[h] += 1;
                } else if t < lo + 16 {
                    if table.first[h] == 127 {
                        table.first[h] = steps[j];
                    } else if table.second[h] == 127 {
                        table.second[h] = steps[j];
                    } else {
                        return None;
                    }
                }
                j += 1;
            }
            h += 1;
        }
        Some(table)
    }

    /// `F(m)` at exponent difference 0 for a mantissa `m` in `0..128`.
    #[inline(always)]
    fn at(&self, m: i8) -> u8 {
        let h = (m as u8 >> 4) as usize & 7;
        self.count[h] + (m > self.first[h]) as u8 + (m > self.second[h]) as u8
    }

    /// The three tables, each 8 bytes repeated over a vector's 128-bit lanes.
    #[inline(always)]
    fn words(&self) -> [i64; 3] {
        [
            i64::from_le_bytes(self.count),
            i64::from_le_bytes(self.first.map(|c| c as u8)),
            i64::from_le_bytes(self.second.map(|c| c as u8)),
        ]
    }
}

/// `F = code + F_BIAS` keeps the codes that matter in a byte: `F < 16` rounds to ±0 (the
/// quotient is below `2^-10`), `16 ≤ F < 56` is e4m3's subnormal range (left to the
/// division), `56..=174` the normal codes `8..=126`, above saturates.
const F_BIAS: u8 = 48;
/// The largest clamped exponent difference: `F ≥ 8·22 ≥ 126 + F_BIAS` saturates.
const D_MAX: u8 = 22;

/// The part of a [`DivisionPlan`] that depends on the scale's mantissa only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PlanShape {
    /// The scale's 23 mantissa bits (`u32::MAX` in the unused entries of [`KNOWN_SHAPES`]).
    frac: u32,
    /// `t_j − 1` as signed bytes (`−1..=127`): `R` steps up at mantissas `m > t_j − 1`.
    steps: [i8; 8],
    /// `R(0)`: the rounded pattern of `RN(1 / M)`.
    base: u32,
    /// The steps by bucket, with `R(0) mod 8` (`None`: the plan does not apply).
    table: Option<StepTable>,
}

impl PlanShape {
    /// The shape of the scales with mantissa bits `frac` (`M = 1 + frac·2^-23`).
    const fn new(frac: u32) -> Self {
        let base = rounded_pattern((1.0 / f32::from_bits(frac | 127 << 23)).to_bits());
        // `M·2^23`.
        let m_s = (frac | 1 << 23) as u64;
        let mut steps = [0i8; 8];
        let mut j = 0;
        while j < 8 {
            // The smallest f32 pattern `g` whose rounded pattern is `c = base + j + 1`: the
            // half-way point below `c` rounds up to `c` when `c` is even, else the next
            // pattern. `RN(q) ≥ g` exactly when `q` reaches the midpoint `μ` between `g`
            // and the f32 below it (a tie at `μ` rounds to the even one of the two: `g`
            // when `g` is even). With `q = (128 + m) / (128·M)`, that is `128 + m ≥
            // 128·μ·M` (strictly when `g` is odd), where `μ = (2^24 + 2·g_frac − 1)·
            // 2^(g_exp − 151)`: `128·μ·M = a·m_s / 2^(167 − g_exp)`, exact in u64.
            let c = base + j as u32 + 1;
            let g = (c << 20) - 0x8_0000 + (c & 1);
            let a = ((g & 0x7f_ffff) << 1 | 1 << 24) as u64 - 1;
            let k = 167 - (g >> 23);
            let p = a * m_s;
            let t = if g & 1 == 0 {
                (p + (1 << k) - 1) >> k
            } else {
                (p >> k) + 1
            };
            // `t − 128` clamped to `0..=128`, minus one.
            let t = if t < 128 {
                0
            } else if t > 256 {
                128
            } else {
                t - 128
            };
            steps[j] = (t as i16 - 1) as i8;
            j += 1;
        }
        PlanShape {
            frac,
            steps,
            base,
            table: StepTable::new(&steps, (base & 7) as u8),
        }
    }
}

/// `e4m3_encode`'s normal code of the positive f32 pattern `b` before its rebias: `b`
/// rounded to nearest even at bit 20, shifted down by 20.
const fn rounded_pattern(b: u32) -> u32 {
    (b + 0x7_ffff + ((b >> 20) & 1)) >> 20
}

/// The shapes of the V3.2 index-K scales `max(amax, 1e-4) / 448` (a bf16 `amax` has 128
/// mantissas), found at compile time, in the entry of their top 8 mantissa bits (one
/// scale an entry: checked when the table is built).
static KNOWN_SHAPES: [PlanShape; 256] = known_shapes();

const fn known_shapes() -> [PlanShape; 256] {
    let unused = PlanShape {
        frac: u32::MAX,
        steps: [0; 8],
        base: 0,
        table: None,
    };
    let mut table = [unused; 256];
    let mut i = 0;
    while i <= 128 {
        // The 128 bf16 mantissas at one exponent, then an amax under the floor.
        let amax = if i < 128 {
            f32::from_bits(127 << 23 | i << 16)
        } else {
            0.0
        };
        let frac = sparsekit_kernels::fp8::index_k_scale(amax, false).to_bits() & 0x7f_ffff;
        let at = (frac >> 15) as usize;
        assert!(
            table[at].frac == u32::MAX,
            "two index-K scales share an entry"
        );
        table[at] = PlanShape::new(frac);
        assert!(
            table[at].table.is_some(),
            "a step table for every index-K scale"
        );
        i += 1;
    }
    table
}

impl DivisionPlan {
    /// The plan of scale `s`, or `None` where the integer steps would not hold: `s` not a
    /// positive normal f32 with biased exponent in `13..=230` (below, a subnormal or
    /// zero `x` could leave the rounding-to-zero range; above, ±inf and NaN inputs sit
    /// inside the clamped exponent range). The index-K scales' shapes come from
    /// [`KNOWN_SHAPES`], others are computed (about 8 multiplies).
    #[inline(always)]
    fn new(s: f32) -> Option<Self> {
        let bits = s.to_bits();
        let e = bits >> 23;
        if !(13..=230).contains(&e) {
            return None;
        }
        let frac = bits & 0x7f_ffff;
        let known = &KNOWN_SHAPES[(frac >> 15) as usize];
        // The plan built from the table in place: a copy of a whole shape (and a plan merged
        // from two sources) went through the stack, where each key's vector load of it
        // waited on a store-to-load forward that failed (one load from several stores).
        let computed;
        let shape = if known.frac == frac {
            known
        } else {
            computed = PlanShape::new(frac);
            &computed
        };
        // F = R(m) − R(0) + 8·D + offset with D = E − e_base: 8·e_base = 8·e + 912 −
        // R(0) + offset, so that F = code + F_BIAS.
        Some(DivisionPlan {
            table: shape.table?,
            e_base: (e + 114 - (shape.base >> 3)) as u8,
        })
    }

    /// `dst[i] = e4m3(src[i] / s)`: blocks of 32 on the bf16 patterns, the blocks left
    /// undecided and the values past the last whole block by f32 division.
    #[inline(always)]
    fn quantize(&self, isa: CpuIsa, dst: &mut [u8], src: &[bf16], s: f32) {
        // The AVX-512 paths take two blocks a vector.
        #[cfg(target_arch = "x86_64")]
        let (dst, src) = if matches!(isa.isa(), Isa::Amx | Isa::Avx512Bf16 | Isa::Avx512) {
            for (d, x) in dst.chunks_exact_mut(64).zip(src.chunks_exact(64)) {
                // SAFETY: a `CpuIsa` names only a path this CPU supports (AVX-512F and
                // AVX-512BW on these two).
                if !unsafe { self.encode_blocks_avx512(d, x) } {
                    divide_exactly(d, x, s);
                }
            }
            let n = src.len() / 64 * 64;
            (&mut dst[n..], &src[n..])
        } else {
            (dst, src)
        };
        let mut blocks = dst.chunks_exact_mut(32).zip(src.chunks_exact(32));
        for (d, x) in blocks.by_ref() {
            if !self.encode_block(isa, d, x) {
                divide_exactly(d, x, s);
            }
        }
        let n = src.len() / 32 * 32;
        divide_exactly(&mut dst[n..], &src[n..], s);
    }

    /// Writes the codes of 32 values, or returns `false` (leaving `dst` to be rewritten)
    /// when one of them falls in e4m3's subnormal range. Byte lanes, no branch: the
    /// exponent difference `D = E − e_base` clamped to `0..=D_MAX` (below, the code is
    /// ±0; above, saturated, ±inf included), `F = R(m) − R(0) + 8·D + offset`, the code
    /// `min(F, 126 + F_BIAS) − F_BIAS` (saturating at 0), NaN one above 126, the sign
    /// bit on top.
    #[inline(always)]
    fn encode_block(&self, isa: CpuIsa, dst: &mut [u8], src: &[bf16]) -> bool {
        match isa.isa() {
            // SAFETY: a `CpuIsa` names only a path this CPU supports (AVX2 is part of
            // each of these).
            #[cfg(target_arch = "x86_64")]
            Isa::Amx | Isa::Avx512Bf16 | Isa::Avx512 | Isa::Avx2 => unsafe {
                self.encode_block_avx2(dst, src)
            },
            _ => self.encode_block_portable(dst, src),
        }
    }

    /// [`DivisionPlan::encode_block`] in AVX2 byte lanes: the 32 patterns packed to their
    /// mantissa, exponent and sign bytes, then one 32-byte vector per step.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn encode_block_avx2(&self, dst: &mut [u8], src: &[bf16]) -> bool {
        use std::arch::x86_64::*;
        assert!(dst.len() >= 32, "a block is 32 values");
        // SAFETY: AVX2 (this function's contract). The bytes' order is put back by the
        // final permute.
        let [m, e, sign] = unsafe { bf16_fields_avx2(src) };
        let sign = _mm256_and_si256(sign, _mm256_set1_epi8(-128));
        // The mantissas' buckets `m >> 4` (`m < 128`: the bits shifted in from the next
        // byte are masked off), looked up in the step tables.
        let [count, first, second] = self.table.words();
        let (count, first, second) = (
            _mm256_set1_epi64x(count),
            _mm256_set1_epi64x(first),
            _mm256_set1_epi64x(second),
        );
        let h = _mm256_and_si256(_mm256_srli_epi16::<4>(m), _mm256_set1_epi8(0x0f));
        let f = _mm256_shuffle_epi8(count, h);
        let f = _mm256_sub_epi8(f, _mm256_cmpgt_epi8(m, _mm256_shuffle_epi8(first, h)));
        let f = _mm256_sub_epi8(f, _mm256_cmpgt_epi8(m, _mm256_shuffle_epi8(second, h)));
        let d = _mm256_min_epu8(
            _mm256_subs_epu8(e, _mm256_set1_epi8(self.e_base as i8)),
            _mm256_set1_epi8(D_MAX as i8),
        );
        // `d ≤ 22`: the 16-bit shift moves no bit across a byte.
        let f = _mm256_add_epi8(f, _mm256_slli_epi16::<3>(d));
        let below = _mm256_sub_epi8(f, _mm256_set1_epi8(16));
        let undecided = _mm256_cmpeq_epi8(_mm256_min_epu8(below, _mm256_set1_epi8(39)), below);
        let mag = _mm256_subs_epu8(
            _mm256_min_epu8(f, _mm256_set1_epi8((126 + F_BIAS) as i8)),
            _mm256_set1_epi8(F_BIAS as i8),
        );
        let nan = _mm256_and_si256(
            _mm256_cmpeq_epi8(e, _mm256_set1_epi8(-1)),
            _mm256_cmpgt_epi8(m, _mm256_setzero_si256()),
        );
        let code = _mm256_or_si256(_mm256_sub_epi8(mag, nan), sign);
        let code = _mm256_permute4x64_epi64::<0b11_01_10_00>(code);
        // SAFETY: as above.
        unsafe { raw::write::<__m256i>(dst.as_mut_ptr().cast(), code) };
        _mm256_movemask_epi8(undecided) == 0
    }

    /// [`DivisionPlan::encode_block`] for two blocks (64 values) in AVX-512 byte lanes,
    /// with mask registers for the steps, the subnormal test and NaN; `false` when either
    /// block is undecided.
    ///
    /// # Safety
    /// The CPU must support AVX-512F and AVX-512BW.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    #[allow(
        clippy::incompatible_msrv,
        reason = "AVX-512 needs Rust 1.89, as the existing AVX-512 target features do"
    )]
    unsafe fn encode_blocks_avx512(&self, dst: &mut [u8], src: &[bf16]) -> bool {
        use std::arch::x86_64::*;
        assert!(
            dst.len() >= 64 && src.len() >= 64,
            "two blocks are 64 values"
        );
        // SAFETY: 64 bf16 (128 bytes) read, 64 bytes written: in bounds (asserted).
        let (h0, h1) = unsafe {
            (
                raw::read::<__m512i>(src.as_ptr().cast()),
                raw::read::<__m512i>(src.as_ptr().add(32).cast()),
            )
        };
        let low7 = _mm512_set1_epi16(0x7f);
        let low8 = _mm512_set1_epi16(0xff);
        // Bytes in 8-byte groups ordered h0, h1 per 128-bit lane, put back by the final
        // permute.
        let m = _mm512_packus_epi16(_mm512_and_si512(h0, low7), _mm512_and_si512(h1, low7));
        let e = _mm512_packus_epi16(
            _mm512_and_si512(_mm512_srli_epi16::<7>(h0), low8),
            _mm512_and_si512(_mm512_srli_epi16::<7>(h1), low8),
        );
        let sign = _mm512_packs_epi16(h0, h1);
        let one = _mm512_set1_epi8(1);
        // As in the AVX2 encoder.
        let [count, first, second] = self.table.words();
        let (count, first, second) = (
            _mm512_set1_epi64(count),
            _mm512_set1_epi64(first),
            _mm512_set1_epi64(second),
        );
        let h = _mm512_and_si512(_mm512_srli_epi16::<4>(m), _mm512_set1_epi8(0x0f));
        let f = _mm512_shuffle_epi8(count, h);
        let above = _mm512_cmpgt_epi8_mask(m, _mm512_shuffle_epi8(first, h));
        let f = _mm512_mask_add_epi8(f, above, f, one);
        let above = _mm512_cmpgt_epi8_mask(m, _mm512_shuffle_epi8(second, h));
        let f = _mm512_mask_add_epi8(f, above, f, one);
        let d = _mm512_min_epu8(
            _mm512_subs_epu8(e, _mm512_set1_epi8(self.e_base as i8)),
            _mm512_set1_epi8(D_MAX as i8),
        );
        // `d ≤ 22`: the 16-bit shift moves no bit across a byte.
        let f = _mm512_add_epi8(f, _mm512_slli_epi16::<3>(d));
        let undecided = _mm512_cmplt_epu8_mask(
            _mm512_sub_epi8(f, _mm512_set1_epi8(16)),
            _mm512_set1_epi8(40),
        );
        let mag = _mm512_subs_epu8(
            _mm512_min_epu8(f, _mm512_set1_epi8((126 + F_BIAS) as i8)),
            _mm512_set1_epi8(F_BIAS as i8),
        );
        let nan = _mm512_mask_cmpgt_epi8_mask(
            _mm512_cmpeq_epi8_mask(e, _mm512_set1_epi8(-1)),
            m,
            _mm512_setzero_si512(),
        );
        let mag = _mm512_mask_add_epi8(mag, nan, mag, one);
        // `mag | (sign & 0x80)`.
        let code = _mm512_ternarylogic_epi32::<0xf8>(mag, sign, _mm512_set1_epi8(-128));
        let code = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), code);
        // SAFETY: as above.
        unsafe { raw::write::<__m512i>(dst.as_mut_ptr().cast(), code) };
        undecided == 0
    }

    /// [`DivisionPlan::encode_block`] lane by lane (the vector paths' steps).
    #[inline(always)]
    fn encode_block_portable(&self, dst: &mut [u8], src: &[bf16]) -> bool {
        let mut lowest = u8::MAX;
        for (d, x) in dst[..32].iter_mut().zip(&src[..32]) {
            let h = x.to_bits();
            let e = (h >> 7) as u8;
            let m = (h & 0x7f) as i8;
            let f = self.table.at(m) + (e.saturating_sub(self.e_base).min(D_MAX) << 3);
            lowest = lowest.min(f.wrapping_sub(16));
            let mag = f.min(126 + F_BIAS).saturating_sub(F_BIAS) + (e == 0xff && m != 0) as u8;
            *d = ((h >> 8) as u8 & 0x80) | mag;
        }
        lowest >= 40
    }
}

/// [`e4m3_encode`] (the same code for every f32) in fewer vector operations: the
/// saturation and NaN selects become an unsigned minimum and an add of the NaN test, the
/// rebias folds into the rounding add, and the subnormal result is masked from the
/// rounded sum rather than subtracted. About 17 operations a lane against 25 for the
/// reference's selects (AVX2 has no mask registers: each select is a compare and a blend).
#[inline(always)]
fn encode_lanes(x: f32) -> u8 {
    let bits = x.to_bits();
    let abits = bits & 0x7fff_ffff;
    // Normal range: round at bit 20 to nearest even and rebias in one add (the carry runs
    // into the exponent); 448 and above (inf, NaN too) saturate to 0x7e. Below the normal
    // range the difference wraps to a large value: the subnormal select replaces it.
    let t = abits.wrapping_add((0x7_ffff_u32 + ((abits >> 20) & 1)).wrapping_sub(120 << 23)) >> 20;
    let normal = t.min(0x7e);
    // Subnormal range (`|x| < 2^-6`): `|x| · 512 < 8` exactly, rounded to an integer
    // (ties to even) in the low mantissa bits of `· + 2^23`.
    // The two tests compare floats: one vector compare each (as integers, LLVM knows
    // `abits` is non-negative, makes them unsigned, and AVX2 has no unsigned compare).
    const TWO_23: f32 = 8_388_608.0;
    let a = f32::from_bits(abits);
    let sub = (a * 512.0 + TWO_23).to_bits() & 0xf;
    let mag = if a < 1.0 / 64.0 { sub } else { normal };
    // NaN: 0x7e + 1.
    let mag = mag + a.is_nan() as u32;
    ((bits >> 24) & 0x80 | mag) as u8
}

/// Smallest biased exponent of a scale [`quantize_pow2`] takes (`2^-116`: every bf16
/// below the smallest normal then divides to below half the smallest e4m3 step).
const POW2_EXP_MIN: u32 = 127 - 116;

/// `dst[i] = e4m3(src[i] / 2^k)` for `k` in `-116..=126`, on the 16-bit patterns: the
/// quotient of a bf16 by a power of two is the bf16 with its exponent lowered by `k`, so
/// for a result in e4m3's normal range the code is the pattern's round-to-nearest-even
/// shift by 4 bits, re-biased — 16-bit lanes (32 values per AVX-512 vector) instead of
/// 32-bit ones. Results below e4m3's smallest normal round to 0 when under half its
/// smallest subnormal; where one does not (rare: `|x| / s` in `[2^-10, 2^-6)`) the whole
/// blocks of 32 are encoded again through f32, as are the values past the last whole
/// block and every value for `k > 119` (a tile whose largest magnitude is within a factor
/// 2 of bf16's largest). Saturates at ±448 (`0x7e`, ±inf too), NaN gives `0x7f`, as
/// [`e4m3_encode`].
#[inline(always)]
fn quantize_pow2(dst: &mut [u8], src: &[bf16], k: i32) {
    let r = f32::from_bits(((127 - k) as u32) << 23);
    let by_f32 = |dst: &mut [u8], src: &[bf16]| {
        for (d, v) in dst.iter_mut().zip(src) {
            *d = e4m3_encode(bf16_to_f32(v.to_bits()) * r);
        }
    };
    if k > 119 {
        by_f32(dst, src);
        return;
    }
    // |x| patterns from `zero_below` up round to ±0; from `normal_from` up they are normal
    // e4m3 values, whose code is `(a + 7 + lsb − rebias) >> 4`. Below `zero_below` the
    // saturating subtraction gives 0 (`zero_below + 8 ≤ rebias`), and with `k ≤ 119`
    // every pattern from +inf's (`0x7f80`) up saturates to `0x7e`, so the map is one
    // expression with no select; NaN (above +inf) adds one.
    let zero_below = ((117 + k) << 7) as u16;
    let normal_from = ((121 + k) << 7) as u16;
    let rebias = ((120 + k) << 7) as u16;
    // Per lane, the least `a − zero_below` (wrapping) over the whole blocks: below
    // `normal_from − zero_below` when a value falls between the two. Reduced once, at the
    // end: then the whole blocks are encoded through f32 (rare).
    let mut band = [u16::MAX; 32];
    for (d, x) in dst.chunks_exact_mut(32).zip(src.chunks_exact(32)) {
        for ((d, v), band) in d.iter_mut().zip(x).zip(&mut band) {
            let h = v.to_bits();
            let a = h & 0x7fff;
            let mag = ((a + 7 + ((a >> 4) & 1)).saturating_sub(rebias) >> 4).min(0x7e);
            let mag = mag + u16::from(a > 0x7f80);
            *band = (*band).min(a.wrapping_sub(zero_below));
            *d = ((h >> 8) & 0x80 | mag) as u8;
        }
    }
    let n = src.len() / 32 * 32;
    if band.iter().fold(u16::MAX, |m, &b| m.min(b)) < normal_from - zero_below {
        by_f32(&mut dst[..n], &src[..n]);
    }
    by_f32(&mut dst[n..], &src[n..]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};

    crate::isa_dispatch! {
        fn quantize_on(dst: &mut [u8], src: &[bf16], s: f32) = |ISA| quantize(ISA, dst, src, s);
    }

    crate::isa_dispatch! {
        fn fp4_groups_on(dst: &mut [u8], scales: &mut [u8], src: &[bf16]) = |ISA| {
            for ((d, sc), g) in dst
                .chunks_exact_mut(FP4_GROUP / 2)
                .zip(scales.iter_mut())
                .zip(src.chunks_exact(FP4_GROUP))
            {
                *sc = encode_fp4_group(ISA, d, g, fp4_group_max(g));
            }
        };
    }

    /// The token-parallel stores write what one token at a time writes (the per-token
    /// writers into each token's page, in order), on every vector path and layout: enough
    /// tokens for several parallel tasks, random slots over a pool twice their size, some
    /// tokens skipped (-1), page sizes that are and are not powers of two, the rest of the
    /// cache poisoned; a repeated slot is a typed error that writes nothing.
    #[test]
    fn parallel_stores_match_token_at_a_time() {
        use crate::dtype::ScaleFormat;
        use crate::error::Error;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        let tokens = 5 * TASK_TOKENS + 17;
        for page_size in [64, 37] {
            let pages = 2 * tokens.div_ceil(page_size);
            let mut slots: Vec<i64> = (0..(pages * page_size) as i64).collect();
            slots.shuffle(&mut rng);
            slots.truncate(tokens);
            for s in slots.iter_mut().filter(|_| rng.gen_bool(0.1)) {
                *s = -1;
            }
            let mut repeated = slots.clone();
            let at = repeated.iter().rposition(|&s| s >= 0).unwrap();
            repeated[at] = repeated[..at].iter().copied().find(|&s| s >= 0).unwrap();
            let values = |n: usize, rng: &mut rand_chacha::ChaCha8Rng| -> Vec<bf16> {
                (0..n)
                    .map(|_| {
                        bf16::from_f32(
                            rng.gen_range(-3.0f32..3.0) * 2f32.powi(rng.gen_range(-8..8)),
                        )
                    })
                    .collect()
            };
            let poison = |n: usize| vec![0x5au8; n];
            for dtype in [
                KvDtype::Bf16,
                KvDtype::Fp8DsMla,
                KvDtype::Model1Fp8,
                KvDtype::Bf16x512,
            ] {
                let l = match dtype {
                    KvDtype::Model1Fp8 => KvLayout::model1_fp8(page_size),
                    KvDtype::Bf16x512 => KvLayout::bf16_512(page_size),
                    _ => KvLayout::new(dtype, 512, 64, page_size),
                }
                .unwrap();
                let kv = values(tokens * l.d_qk(), &mut rng);
                let bytes = l.buffer_bytes(pages);
                for isa in CpuIsa::available() {
                    let mut want = poison(bytes);
                    for (t, &s) in slots.iter().enumerate().filter(|(_, &s)| s >= 0) {
                        let a = l.slot_addr(s as usize);
                        let page = &mut want[l.page_bytes(a.page)];
                        write_kv_token_on(isa, &l, page, a.offset, row(&kv, t, l.d_qk()));
                    }
                    let mut got = poison(bytes);
                    kv_store(
                        isa,
                        &KvStore {
                            layout: l,
                            slots: &slots,
                        },
                        &kv,
                        &mut got,
                    )
                    .unwrap();
                    assert!(
                        got == want,
                        "{} {} page {page_size}",
                        l.dtype().name(),
                        isa.isa()
                    );
                    let mut untouched = poison(bytes);
                    let op = KvStore {
                        layout: l,
                        slots: &repeated,
                    };
                    let e = kv_store(isa, &op, &kv, &mut untouched).unwrap_err();
                    assert!(matches!(e, Error::DuplicateSlot { .. }), "{e}");
                    assert!(untouched == poison(bytes));
                }
            }
            for dtype in [
                IndexKDtype::FP8,
                IndexKDtype::Fp8E4m3 {
                    scale: ScaleFormat::Ue8m0,
                },
                IndexKDtype::Bf16,
                IndexKDtype::Fp4E2m1,
            ] {
                let l = IndexKLayout::new(dtype, 128, page_size).unwrap();
                let keys = values(tokens * 128, &mut rng);
                let bytes = l.buffer_bytes(pages);
                for isa in CpuIsa::available() {
                    let mut want = poison(bytes);
                    for (t, &s) in slots.iter().enumerate().filter(|(_, &s)| s >= 0) {
                        let a = l.slot_addr(s as usize);
                        let page = &mut want[l.page_bytes(a.page)];
                        write_index_k_token_on(isa, &l, page, a.offset, row(&keys, t, 128));
                    }
                    let mut got = poison(bytes);
                    let op = IndexKStore {
                        layout: l,
                        slots: &slots,
                    };
                    index_k_store(isa, &op, &keys, &mut got).unwrap();
                    assert!(
                        got == want,
                        "{} {} page {page_size}",
                        l.dtype().name(),
                        isa.isa()
                    );
                    let mut untouched = poison(bytes);
                    let op = IndexKStore {
                        layout: l,
                        slots: &repeated,
                    };
                    let e = index_k_store(isa, &op, &keys, &mut untouched).unwrap_err();
                    assert!(matches!(e, Error::DuplicateSlot { .. }), "{e}");
                    assert!(untouched == poison(bytes));
                }
            }
        }
    }

    /// Every bf16 bit pattern once, shuffled (so blocks of 32 mix magnitudes).
    fn all_bf16(rng: &mut impl Rng) -> Vec<bf16> {
        let mut src: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        src.shuffle(rng);
        src
    }

    /// The division path's encoder gives [`e4m3_encode`]'s code for every f32 sign and
    /// exponent, with the mantissa's low bits where the roundings decide (the half-way
    /// bit, the even bit, the bits below) at every value and a random rest; NaNs of
    /// both signs and payloads.
    #[test]
    fn encode_lanes_is_e4m3_encode() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for sign in [0, 0x8000_0000u32] {
            for exp in 0..=255u32 {
                for low in 0..1u32 << 12 {
                    // Bits 20..23 (the kept mantissa), 16..20 just under them (the
                    // half-way and sticky bits) from `low`; the rest random.
                    let m = (low & 0xf) << 20 | (low >> 4 & 0xff) << 12 | rng.gen_range(0..1 << 12);
                    for m in [m, m & !0xfff, m | 0xfff] {
                        let x = f32::from_bits(sign | exp << 23 | m);
                        assert_eq!(encode_lanes(x), e4m3_encode(x), "{:#010x}", x.to_bits());
                    }
                }
            }
        }
    }

    /// Every vector path of `quantize` gives the bytes of the division (e4m3 of the f32
    /// quotient) for every bf16 value (NaN, infinities, subnormals included): at every
    /// power-of-two scale (the 16-bit path), at random normal scales (the V3.2 index-K
    /// `amax / 448`, through division plans; the plans' exponent range edges) and special
    /// ones, in calls of a store's lengths (a tile of 64 or 128, a key of 128) and of lengths
    /// with tails past the last block of 32 (and of 64): a block falling back to f32 must
    /// not hide another call's blocks.
    #[test]
    fn quantize_matches_division_bitwise() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        let all = all_bf16(&mut rng);
        let from = rng.gen_range(0..32);
        let mut scales: Vec<f32> = (-126..=127).map(|e| 2f32.powi(e)).collect();
        scales.extend([
            f32::INFINITY,
            f32::NAN,
            0.0,
            1e-4,
            0.3,
            448.0 / 3.0,
            f32::MIN_POSITIVE / 4.0,
            f32::MAX,
        ]);
        scales.extend((0..24).map(|_| f32::from_bits(rng.gen_range(0x0080_0000..0x7f80_0000))));
        scales.extend((0..24).map(|_| {
            let amax = bf16::from_bits(rng.gen_range(0x0080..0x7f80)).to_f32();
            amax / 448.0
        }));
        // At the edges of the division plans' exponent range, random mantissas.
        scales.extend(
            [11u32, 12, 13, 14, 229, 230, 231, 232]
                .map(|e| f32::from_bits(e << 23 | rng.gen_range(1..1 << 23))),
        );
        let mut dst = vec![0u8; all.len()];
        // Tails past the last block of 64 shorter and longer than 32.
        for (isa, src) in CpuIsa::available().into_iter().flat_map(|isa| {
            [
                (isa, &all[from..all.len() - 7]),
                (isa, &all[from..all.len() - 39]),
            ]
        }) {
            let dst = &mut dst[..src.len()];
            for &s in &scales {
                dst.fill(0xaa);
                let mut at = 0;
                for len in [128, 64, 96, 32, 200, 71].into_iter().cycle() {
                    let end = (at + len).min(src.len());
                    quantize_on(isa, &mut dst[at..end], &src[at..end], s);
                    at = end;
                    if at == src.len() {
                        break;
                    }
                }
                for (d, v) in dst.iter().zip(src) {
                    let want = e4m3_encode(bf16_to_f32(v.to_bits()) / s);
                    assert_eq!(
                        *d,
                        want,
                        "{} bf16 {:#06x}, scale {s:e}",
                        isa.isa(),
                        v.to_bits()
                    );
                }
            }
        }
    }

    /// The compile-time table holds, for every index-K scale (every bf16 `amax` mantissa,
    /// and the floor), the shape computed at run time, under its own mantissa.
    #[test]
    fn known_shapes_are_the_index_k_scales_shapes() {
        let mut found = 0;
        for amax in (0..128u32)
            .map(|m| f32::from_bits(127 << 23 | m << 16))
            .chain([sparsekit_kernels::fp8::SCALE_FLOOR])
        {
            for e in [-60, -3, 0, 7, 40] {
                let s = index_k_scale(amax * 2f32.powi(e), crate::dtype::ScaleFormat::Fp32);
                let frac = s.to_bits() & 0x7f_ffff;
                let known = KNOWN_SHAPES[(frac >> 15) as usize];
                if amax == sparsekit_kernels::fp8::SCALE_FLOOR && e < 0 {
                    continue; // floored: the same scale as e = 0.
                }
                assert_eq!(known.frac, frac, "amax {amax:e} · 2^{e}");
                assert_eq!(known, PlanShape::new(frac));
                found += 1;
            }
        }
        assert_eq!(found, 128 * 5 + 3);
        let used = KNOWN_SHAPES.iter().filter(|k| k.frac != u32::MAX).count();
        assert_eq!(used, 129);
    }

    /// A plan's steps are the f32 division's: for every mantissa `m` of a bf16 in
    /// `[1, 2)`, the rounded pattern of `RN((1 + m/128) / M)` is `R(0)` plus the steps at
    /// or below `m`, for random mantissas `M` and every index-K scale's; the step table
    /// (every scale mantissa has one) counts the same steps.
    #[test]
    fn plan_steps_are_the_division_steps() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        let fracs = (0..4096)
            .map(|_| rng.gen_range(0..1u32 << 23))
            .chain([0, 1, 0x7f_ffff, 0x40_0000, 0x3f_ffff])
            .chain(
                KNOWN_SHAPES
                    .iter()
                    .map(|k| k.frac)
                    .filter(|&f| f != u32::MAX),
            );
        for frac in fracs {
            let shape = PlanShape::new(frac);
            let table = shape.table.expect("a step table for every scale mantissa");
            let m_s = f32::from_bits(127 << 23 | frac);
            for m in 0..128u32 {
                let q = f32::from_bits(127 << 23 | m << 16) / m_s;
                let steps = shape
                    .steps
                    .iter()
                    .filter(|&&t| m as i32 > i32::from(t))
                    .count();
                assert_eq!(
                    rounded_pattern(q.to_bits()),
                    shape.base + steps as u32,
                    "mantissa {frac:#08x}, m {m}"
                );
                assert_eq!(
                    u32::from(table.at(m as i8)),
                    (shape.base & 7) + steps as u32,
                    "mantissa {frac:#08x}, m {m}: the step table"
                );
            }
        }
    }

    /// `amax` is `amax_bf16` on keys of every length around the 32 lanes, with and without
    /// NaN (anywhere, also as the largest pattern) and ±inf.
    #[test]
    fn amax_is_amax_bf16() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for n in [0, 1, 31, 32, 33, 64, 100, 128, 512] {
            for special in [None, Some(0x7fc1), Some(0xffff), Some(0x7f81), Some(0xff80)] {
                let mut xs: Vec<bf16> = (0..n)
                    .map(|_| bf16::from_bits(rng.gen_range(0..0x7f80) | rng.gen::<u16>() & 0x8000))
                    .collect();
                if let (Some(bits), false) = (special, xs.is_empty()) {
                    let at = rng.gen_range(0..n);
                    xs[at] = bf16::from_bits(bits);
                }
                assert_eq!(
                    amax(&xs).to_bits(),
                    crate::dtype::amax_bf16(&xs).to_bits(),
                    "n {n}, {special:?}"
                );
            }
        }
    }

    /// The scale byte on the bits is `mx::fp4_group_scale`'s for every finite bf16 group
    /// maximum.
    #[test]
    fn fp4_scale_bytes_are_the_group_scales() {
        for b in 0..0x7f80u32 {
            let s = mx::fp4_group_scale(bf16_to_f32(b as u16));
            assert_eq!(fp4_scale_byte(b), mx::ue8m0_encode(s), "max bits {b:#06x}");
        }
    }

    /// A step table counts the steps below each bucket and keeps those inside it; three
    /// steps in one bucket (no scale's steps are that close) leave no table, so no plan.
    #[test]
    fn step_tables_hold_two_steps_a_bucket() {
        let table = StepTable::new(&[-1, 3, 12, 40, 47, 127, 127, 127], 5).unwrap();
        assert_eq!(table.count, [6, 8, 8, 10, 10, 10, 10, 10]);
        assert_eq!(table.first, [3, 127, 40, 127, 127, 127, 127, 127]);
        assert_eq!(table.second, [12, 127, 127, 127, 127, 127, 127, 127]);
        let at: Vec<u8> = [0, 3, 4, 12, 13, 16, 40, 41, 47, 48, 127]
            .iter()
            .map(|&m| table.at(m))
            .collect();
        assert_eq!(at, [6, 6, 7, 7, 8, 8, 8, 9, 9, 10, 10]);
        // Steps from mantissas 21, 27 and 31: three in bucket 1; 21, 27 and 32: two.
        assert!(StepTable::new(&[-1, 20, 26, 30, 127, 127, 127, 127], 0).is_none());
        assert!(StepTable::new(&[-1, 20, 26, 31, 127, 127, 127, 127], 0).is_some());
    }

    crate::isa_dispatch! {
        /// The plan's encoders of path `ISA` on 64 values: two blocks of 32, and on the
        /// AVX-512 paths the two-block encoder; whether each decided.
        fn encoders_on(plan: &DivisionPlan, src: &[bf16]) -> Vec<(bool, Vec<u8>)> =
            |ISA| {
                let mut out = Vec::new();
                let mut d = vec![0xaa; 64];
                let halves = plan.encode_block(ISA, &mut d[..32], &src[..32])
                    & plan.encode_block(ISA, &mut d[32..], &src[32..]);
                out.push((halves, d));
                #[cfg(target_arch = "x86_64")]
                if matches!(ISA.isa(), Isa::Amx | Isa::Avx512Bf16 | Isa::Avx512) {
                    let mut d = vec![0xaa; 64];
                    // SAFETY: AVX-512F and AVX-512BW are part of these paths.
                    let both = unsafe { plan.encode_blocks_avx512(&mut d, src) };
                    out.push((both, d));
                }
                out
            };
    }

    /// Blocks whose quotients are all in e4m3's normal range (or round to zero, or
    /// saturate; ±inf and NaN too) are decided by the plan alone, on every path and
    /// encoder, with the division's codes; one value in the subnormal range leaves its
    /// block undecided.
    #[test]
    fn plans_decide_blocks_outside_the_subnormal_range() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        let mut checked = 0;
        for _ in 0..2000 {
            let amax = bf16::from_bits(rng.gen_range(0x0d00..0x7000)).to_f32();
            let s = index_k_scale(amax, crate::dtype::ScaleFormat::Fp32);
            let plan = DivisionPlan::new(s).unwrap();
            let mut src: Vec<bf16> = (0..64)
                .map(|_| {
                    let q = match rng.gen_range(0..16) {
                        0 => 2f32.powi(-12) * rng.gen::<f32>(),
                        1 => 448.0 * rng.gen_range(1.0f32..1e6),
                        2 => f32::INFINITY,
                        3 => f32::NAN,
                        _ => rng.gen_range(1.0f32 / 64.0..448.0),
                    };
                    let sign = if rng.gen() { -1.0 } else { 1.0 };
                    bf16::from_f32(sign * q * s)
                })
                .collect();
            // Values rounded into bf16 can leave the ranges above by a rounding step.
            let undecided = src.iter().any(|v| {
                let q = (bf16_to_f32(v.to_bits()) / s).abs();
                (2f32.powi(-11)..1.0 / 64.0 * 1.01).contains(&q)
            });
            for isa in CpuIsa::available() {
                for (decided, dst) in encoders_on(isa, &plan, &src) {
                    assert!(decided || undecided, "{} scale {s:e}", isa.isa());
                    if decided {
                        checked += 1;
                        for (d, v) in dst.iter().zip(&src) {
                            assert_eq!(*d, e4m3_encode(bf16_to_f32(v.to_bits()) / s));
                        }
                    }
                }
            }
            src[rng.gen_range(0..64)] = bf16::from_f32(s / 128.0);
            for isa in CpuIsa::available() {
                for (decided, _) in encoders_on(isa, &plan, &src) {
                    assert!(!decided, "{}", isa.isa());
                }
            }
        }
        assert!(checked > 2000, "{checked} decided");
    }

    /// Every vector path of the fp4 group quantiser gives the codes of the division by the
    /// group's scale and that scale, for every bf16 value in groups whose largest
    /// magnitude sets every scale exponent (and non-finite groups).
    #[test]
    fn fp4_groups_match_division_bitwise() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        let all = all_bf16(&mut rng);
        for isa in CpuIsa::available() {
            // Group maxima from 2^-133 (subnormal) to bf16's largest finite value.
            for top in (0..0x7f80u16).step_by(0x7f) {
                // 31 values of at most the maximum's magnitude, then the maximum.
                let small: Vec<bf16> = all
                    .iter()
                    .copied()
                    .filter(|v| v.to_bits() & 0x7fff <= top || v.to_bits() & 0x7fff > 0x7f80)
                    .take(31 * 64)
                    .collect();
                let mut src = Vec::new();
                for g in small.chunks_exact(31) {
                    src.extend_from_slice(g);
                    src.push(bf16::from_bits(top | (rng.gen::<u16>() & 0x8000)));
                }
                let groups = src.len() / FP4_GROUP;
                let mut dst = vec![0xaau8; groups * FP4_GROUP / 2];
                let mut scales = vec![0xaau8; groups];
                fp4_groups_on(isa, &mut dst, &mut scales, &src);
                for (g, group) in src.chunks_exact(FP4_GROUP).enumerate() {
                    let max = group
                        .iter()
                        .fold(0u32, |m, x| mx::bf16_abs_bits_max(m, x.to_bits()));
                    let (want_scale, codes): (u8, Vec<u8>) = if mx::abs_bits_non_finite(max) {
                        (mx::UE8M0_NAN, vec![0; FP4_GROUP])
                    } else {
                        let s = mx::fp4_group_scale(bf16_to_f32(max as u16));
                        let codes = group
                            .iter()
                            .map(|x| mx::e2m1_encode(bf16_to_f32(x.to_bits()) / s))
                            .collect();
                        (mx::ue8m0_encode(s), codes)
                    };
                    assert_eq!(scales[g], want_scale, "{} group max {top:#06x}", isa.isa());
                    for (j, pair) in codes.chunks_exact(2).enumerate() {
                        assert_eq!(
                            dst[g * FP4_GROUP / 2 + j],
                            pair[0] | pair[1] << 4,
                            "{} group max {top:#06x}, pair {j}",
                            isa.isa()
                        );
                    }
                }
            }
        }
    }
}
