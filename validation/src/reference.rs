//! Naive f64 references. They read and write the **packed bytes** through the layout
//! descriptors' byte ranges, so layouts are checked as well as arithmetic. The fp8 codec
//! here is written independently of `sparsekit_host::dtype` (nearest-value search over
//! the code table instead of bit manipulation).
//!
//! Rounding contract modelled exactly (see `sparsekit_host::dtype`): scales and quotients
//! are f32 values (`fl32`), computed here in f64 and rounded once to f32, which equals the
//! f32 operation for a quotient of two f32 values.

use std::sync::OnceLock;

use half::bf16;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sparsekit_host::cpu::{CpuIsa, Isa};
use sparsekit_host::dtype::ScaleFormat;
use sparsekit_host::layout::{
    IndexKDtype, IndexKLayout, KvDtype, KvLayout, FP4_GROUP, FP8_DS_MLA_TILE, MODEL1_SCALE_BYTES,
    MODEL1_TILE,
};
use sparsekit_host::ops::{PageTable, QueryRange};

mod v4;
pub use v4::sparse_mla_v4;

/// Value of an e4m3fn code, computed from its fields in f64.
pub fn e4m3_value(code: u8) -> f64 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((code >> 3) & 0xf) as i32;
    let m = (code & 7) as f64;
    if e == 15 && m == 7.0 {
        return f64::NAN;
    }
    let mag = if e == 0 {
        m / 8.0 * 2f64.powi(-6)
    } else {
        (1.0 + m / 8.0) * 2f64.powi(e - 7)
    };
    sign * mag
}

/// [`e4m3_value`] of every code (index with the code), computed once: the readers decode
/// through it instead of evaluating the powers of two per value.
fn e4m3_values() -> &'static [f64; 256] {
    static TABLE: std::sync::OnceLock<[f64; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|c| e4m3_value(c as u8)))
}

/// Positive finite e4m3 values, ascending (codes 0x00..=0x7e).
fn positive_values() -> &'static [f64] {
    &e4m3_values()[..=0x7e]
}

/// e4m3fn encoding by nearest-value search: ties go to the even code, magnitudes at or
/// above 448 saturate, NaN keeps its sign.
pub fn e4m3_encode(x: f64) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    if x.is_nan() {
        return sign | 0x7f;
    }
    let a = x.abs();
    let t = positive_values();
    if a >= t[126] {
        return sign | 0x7e;
    }
    // First code whose value is >= a; compare with its lower neighbour.
    let hi = t.partition_point(|&v| v < a);
    let code = if hi == 0 {
        0
    } else {
        let (lo_v, hi_v) = (t[hi - 1], t[hi]);
        let (dl, dh) = (a - lo_v, hi_v - a);
        if dl < dh || (dl == dh && (hi - 1) % 2 == 0) {
            hi - 1
        } else {
            hi
        }
    };
    sign | code as u8
}

/// Rounds an f64 to the nearest f32 (as f64).
pub fn fl32(x: f64) -> f64 {
    x as f32 as f64
}

/// Smallest power of two `>= s` and `>= 2^-126` (the result for `s ≤ 2^-126`), found by
/// doubling.
pub fn pow2_ceil(s: f64) -> f64 {
    let mut p = 2f64.powi(-126);
    while p < s {
        p *= 2.0;
    }
    p
}

/// Value of a ue8m0 scale byte: `2^(b − 127)`, NaN for `0xff`.
pub fn ue8m0_value(b: u8) -> f64 {
    if b == 0xff {
        f64::NAN
    } else {
        2f64.powi(b as i32 - 127)
    }
}

/// [`ue8m0_value`] of every byte, computed once.
fn ue8m0_values() -> &'static [f64; 256] {
    static TABLE: std::sync::OnceLock<[f64; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|b| ue8m0_value(b as u8)))
}

/// The ue8m0 byte of a power of two `s` (found by halving/doubling from 1), `0xff` for
/// an infinite or NaN `s`.
pub fn ue8m0_byte(s: f64) -> u8 {
    if !s.is_finite() {
        return 0xff;
    }
    let (mut e, mut p) = (0i32, 1.0f64);
    while p < s {
        p *= 2.0;
        e += 1;
    }
    while p > s {
        p /= 2.0;
        e -= 1;
    }
    (e + 127) as u8
}

/// Magnitudes of the e2m1 codes 0..=7.
const E2M1: [f64; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Value of an e2m1 code (low 4 bits).
pub fn e2m1_value(code: u8) -> f64 {
    let m = E2M1[(code & 7) as usize];
    if code & 8 != 0 {
        -m
    } else {
        m
    }
}

/// e2m1 encoding by nearest-value search: ties go to the even code, magnitudes above 6
/// saturate; the sign bit is the sign of `x`.
pub fn e2m1_encode(x: f64) -> u8 {
    let sign = if x.is_sign_negative() { 8 } else { 0 };
    let a = x.abs();
    let mut best = 0usize;
    for (c, v) in E2M1.iter().enumerate().skip(1) {
        let (d, db) = ((v - a).abs(), (E2M1[best] - a).abs());
        if d < db || (d == db && c % 2 == 0) {
            best = c;
        }
    }
    sign | best as u8
}

/// fp4 group scale: the smallest power of two `≥ amax / 6`, at least `2^-126`.
pub fn fp4_group_scale(amax: f64) -> f64 {
    pow2_ceil(amax / 6.0)
}

/// How a quantiser divides by a constant or a scale: ours divides (`x / 448`, `x / s`);
/// DeepSeek's and SGLang's index-K scales multiply by an f32 reciprocal (`amax * (1/448)`),
/// DeepGEMM's `kv_cache_cast_to_fp8` quantises values as `x * (1/s)`. The two differ in
/// the last bit of some results (about a third of bf16 amax values give another scale).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Division {
    /// `fl32(x / d)`.
    #[default]
    Divide,
    /// `fl32(x · fl32(1 / d))`.
    Reciprocal,
}

impl Division {
    /// `x` divided by `d` under this rule (`x`, `d` f32 values; result an f32 value).
    pub fn apply(self, x: f64, d: f64) -> f64 {
        match self {
            Division::Divide => fl32(x / d),
            Division::Reciprocal => fl32(x * fl32(1.0 / d)),
        }
    }
}

/// The rules of a quantiser: how the scale is computed from the amax, how values are
/// divided by it. [`QuantRules::default`] is ours (the kernels').
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct QuantRules {
    pub scale: Division,
    pub values: Division,
}

/// Index-K per-token scale: `fl32(max(amax, fl32(1e-4)) / 448)`, optionally pow2-rounded.
pub fn index_k_scale(amax: f64, format: ScaleFormat) -> f64 {
    index_k_scale_with(amax, format, Division::Divide)
}

/// [`index_k_scale`] with the division by 448 done by `rule`.
pub fn index_k_scale_with(amax: f64, format: ScaleFormat, rule: Division) -> f64 {
    let s = rule.apply(amax.max(fl32(1e-4)), 448.0);
    match format {
        ScaleFormat::Fp32 => s,
        ScaleFormat::Ue8m0 => pow2_ceil(s),
    }
}

/// fp8_ds_mla tile scale: `pow2_ceil(max(fl32(amax / 448), fl32(1e-4)))`.
pub fn kv_tile_scale(amax: f64) -> f64 {
    kv_tile_scale_with(amax, Division::Divide)
}

/// [`kv_tile_scale`] with the division by 448 done by `rule`.
pub fn kv_tile_scale_with(amax: f64, rule: Division) -> f64 {
    pow2_ceil(rule.apply(amax, 448.0).max(fl32(1e-4)))
}

fn amax(xs: &[bf16]) -> f64 {
    xs.iter().fold(0.0, |m, x| m.max((x.to_f64()).abs()))
}

fn put_bf16(dst: &mut [u8], xs: &[bf16]) {
    for (i, x) in xs.iter().enumerate() {
        dst[2 * i..2 * i + 2].copy_from_slice(&x.to_bits().to_le_bytes());
    }
}

/// Appends the first `n` bf16 of little-endian bytes to `out`, as f64 (exact: a bf16's
/// bits are an f32's top half; a NaN stays NaN), on the widest vector path of this CPU.
fn extend_bf16s(out: &mut Vec<f64>, src: &[u8], n: usize) {
    let at = out.len();
    out.resize(at + n, 0.0);
    bf16s_into_on(widest(), &src[..2 * n], &mut out[at..]);
}

sparsekit_host::isa_dispatch! {
    /// `out[i]` = the bf16 of bytes `2i, 2i + 1` of `src` (little-endian) in f64, over the
    /// common length, on the vector path `isa`.
    fn bf16s_into_on(src: &[u8], out: &mut [f64]) = |ISA| {
        for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
            *o = bf16_bits_f64(u16::from_le_bytes([b[0], b[1]]));
        }
    };
}

fn get_f32(src: &[u8], at: usize) -> f64 {
    f32::from_le_bytes([src[at], src[at + 1], src[at + 2], src[at + 3]]) as f64
}

/// Applies `index_k_store` to `cache` (whole pages): token `t`'s key `keys[t*D..]` goes to
/// `slots[t]` (`-1` skipped).
pub fn index_k_store(layout: &IndexKLayout, cache: &mut [u8], keys: &[bf16], slots: &[i64]) {
    index_k_store_with(layout, cache, keys, slots, QuantRules::default())
}

/// [`index_k_store`] under another quantiser's `rules`.
pub fn index_k_store_with(
    layout: &IndexKLayout,
    cache: &mut [u8],
    keys: &[bf16],
    slots: &[i64],
    rules: QuantRules,
) {
    let d = layout.head_dim();
    for (t, &slot) in slots.iter().enumerate() {
        if slot < 0 {
            continue;
        }
        let key = &keys[t * d..(t + 1) * d];
        let values = layout.slot_value_bytes(slot as usize);
        match layout.dtype() {
            IndexKDtype::Bf16 => put_bf16(&mut cache[values], key),
            IndexKDtype::Fp8E4m3 { scale } => {
                let s = index_k_scale_with(amax(key), scale, rules.scale);
                for (i, x) in key.iter().enumerate() {
                    cache[values.start + i] = e4m3_encode(rules.values.apply(x.to_f64(), s));
                }
                if let Some(r) = layout.slot_scale_bytes(slot as usize) {
                    cache[r].copy_from_slice(&(s as f32).to_le_bytes());
                }
            }
            IndexKDtype::Fp4E2m1 => {
                let scales = layout.slot_scale_bytes(slot as usize).unwrap_or(0..0);
                for (g, group) in key.chunks(FP4_GROUP).enumerate() {
                    let finite = group.iter().all(|x| x.to_f64().is_finite());
                    let s = fp4_group_scale(amax(group));
                    cache[scales.start + g] = if finite { ue8m0_byte(s) } else { 0xff };
                    for (i, pair) in group.chunks(2).enumerate() {
                        let code = |x: &bf16| {
                            if finite {
                                e2m1_encode(x.to_f64() / s)
                            } else {
                                0
                            }
                        };
                        cache[values.start + g * FP4_GROUP / 2 + i] =
                            code(&pair[0]) | code(&pair[1]) << 4;
                    }
                }
            }
        }
    }
}

/// Applies `kv_store` to `cache`: token `t`'s `[latent | rope]` goes to `slots[t]`.
pub fn kv_store(layout: &KvLayout, cache: &mut [u8], kv: &[bf16], slots: &[i64]) {
    kv_store_with(layout, cache, kv, slots, QuantRules::default())
}

/// [`kv_store`] under another quantiser's `rules`.
pub fn kv_store_with(
    layout: &KvLayout,
    cache: &mut [u8],
    kv: &[bf16],
    slots: &[i64],
    rules: QuantRules,
) {
    let (d, nope) = (layout.d_qk(), layout.nope_dim());
    for (t, &slot) in slots.iter().enumerate() {
        if slot < 0 {
            continue;
        }
        let x = &kv[t * d..(t + 1) * d];
        if layout.dtype() == KvDtype::Model1Fp8 {
            // Rows, then 8 scale bytes per token (7 tiles + a zero pad) after the rows.
            let sc = layout.slot_tile_scale_bytes(slot as usize).start;
            cache[sc..sc + MODEL1_SCALE_BYTES].fill(0);
            let tok = layout.slot_token_bytes(slot as usize).start;
            for (ti, tile) in x[..nope].chunks(MODEL1_TILE).enumerate() {
                let s = kv_tile_scale_with(amax(tile), rules.scale);
                for (i, v) in tile.iter().enumerate() {
                    cache[tok + ti * MODEL1_TILE + i] =
                        e4m3_encode(rules.values.apply(v.to_f64(), s));
                }
                cache[sc + ti] = ue8m0_byte(s);
            }
            let rope = layout.rope_range();
            put_bf16(&mut cache[tok + rope.start..tok + rope.end], &x[nope..]);
            continue;
        }
        let tok = &mut cache[layout.slot_token_bytes(slot as usize)];
        match layout.dtype() {
            KvDtype::Bf16 | KvDtype::Bf16x512 => {
                put_bf16(&mut tok[layout.nope_range()], &x[..nope])
            }
            KvDtype::Model1Fp8 => unreachable!("stored above"),
            KvDtype::Fp8DsMla => {
                let sr = layout.scales_range();
                for (ti, tile) in x[..nope].chunks(FP8_DS_MLA_TILE).enumerate() {
                    let s = kv_tile_scale_with(amax(tile), rules.scale);
                    for (i, v) in tile.iter().enumerate() {
                        tok[ti * FP8_DS_MLA_TILE + i] =
                            e4m3_encode(rules.values.apply(v.to_f64(), s));
                    }
                    tok[sr.start + 4 * ti..sr.start + 4 * ti + 4]
                        .copy_from_slice(&(s as f32).to_le_bytes());
                }
            }
        }
        put_bf16(&mut tok[layout.rope_range()], &x[nope..]);
    }
}

/// The dequantised index key stored at `slot` (values already multiplied by nothing) and
/// its scale (1 for bf16).
pub fn read_index_key(layout: &IndexKLayout, cache: &[u8], slot: usize) -> (Vec<f64>, f64) {
    let mut v = Vec::with_capacity(layout.head_dim());
    let s = read_index_key_into(layout, cache, slot, &mut v);
    (v, s)
}

/// [`read_index_key`] into `out` (its values replaced; no allocation once it has room):
/// returns the scale.
fn read_index_key_into(
    layout: &IndexKLayout,
    cache: &[u8],
    slot: usize,
    out: &mut Vec<f64>,
) -> f64 {
    let vals = &cache[layout.slot_value_bytes(slot)];
    out.clear();
    match layout.dtype() {
        IndexKDtype::Bf16 => {
            extend_bf16s(out, vals, layout.head_dim());
            1.0
        }
        IndexKDtype::Fp8E4m3 { .. } => {
            out.extend(vals.iter().map(|&c| e4m3_values()[c as usize]));
            layout
                .slot_scale_bytes(slot)
                .map_or(1.0, |r| get_f32(cache, r.start))
        }
        IndexKDtype::Fp4E2m1 => {
            let sc = layout.slot_scale_bytes(slot).unwrap_or(0..0);
            out.extend((0..layout.head_dim()).map(|i| {
                let code = vals[i / 2] >> (4 * (i % 2));
                e2m1_value(code) * ue8m0_values()[cache[sc.start + i / FP4_GROUP] as usize]
            }));
            1.0
        }
    }
}

/// The dequantised `[latent | rope]` of the KV token at `slot`.
pub fn read_kv_token(layout: &KvLayout, cache: &[u8], slot: usize) -> Vec<f64> {
    let tok = &cache[layout.slot_token_bytes(slot)];
    let mut out = Vec::with_capacity(layout.d_qk());
    match layout.dtype() {
        KvDtype::Bf16 | KvDtype::Bf16x512 => extend_bf16s(&mut out, tok, layout.nope_dim()),
        KvDtype::Model1Fp8 => {
            let sc = layout.slot_tile_scale_bytes(slot);
            for i in 0..layout.nope_dim() {
                out.push(
                    e4m3_values()[tok[i] as usize]
                        * ue8m0_values()[cache[sc.start + i / MODEL1_TILE] as usize],
                );
            }
        }
        KvDtype::Fp8DsMla => {
            let sr = layout.scales_range();
            for i in 0..layout.nope_dim() {
                let s = get_f32(tok, sr.start + 4 * (i / FP8_DS_MLA_TILE));
                out.push(e4m3_values()[tok[i] as usize] * s);
            }
        }
    }
    let rope = &tok[layout.rope_range()];
    extend_bf16s(&mut out, rope, layout.rope_dim());
    out
}

/// The bf16 of bits `b` in f64 (exact: a bf16 is the upper half of an f32).
fn bf16_bits_f64(b: u16) -> f64 {
    f32::from_bits((b as u32) << 16) as f64
}

/// bf16 values in f64.
fn bf16_f64s(xs: &[bf16]) -> Vec<f64> {
    xs.iter().map(|x| bf16_bits_f64(x.to_bits())).collect()
}

/// `o[i] += c·v[i]·f` and `a[i] += c·|v[i]|·f` over the common length: the softmax
/// weight `c` of a row `v` into the output and its absolute scale. Each product rounds in
/// that order, with no fused multiply-add, so every vector path gives the same bits; the
/// loop runs on the widest one of this CPU (the crate itself is built for SSE2).
///
/// With `c, f ≥ 0` (the softmax's weights and the sink's factor) `c·|v|·f` is
/// `|c·v·f|` (rounding is symmetric in sign), so the product is taken once: the same
/// bits, two fewer operations an element (a NaN result may differ in its sign bit only).
pub(crate) fn weigh_into(o: &mut [f64], a: &mut [f64], v: &[f64], c: f64, f: f64) {
    weigh_into_on(widest(), o, a, v, c, f)
}

sparsekit_host::isa_dispatch! {
    /// [`weigh_into`] on the vector path `isa`.
    fn weigh_into_on(o: &mut [f64], a: &mut [f64], v: &[f64], c: f64, f: f64) = |ISA| {
        let rows = o.iter_mut().zip(a.iter_mut()).zip(v);
        if c >= 0.0 && f >= 0.0 {
            for ((x, y), v) in rows {
                let p = c * v * f;
                *x += p;
                *y += p.abs();
            }
        } else {
            for ((x, y), v) in rows {
                *x += c * v * f;
                *y += c * v.abs() * f;
            }
        }
    };
}

/// The widest vector path of this CPU, detected once.
fn widest() -> CpuIsa {
    static WIDEST: OnceLock<CpuIsa> = OnceLock::new();
    *WIDEST.get_or_init(CpuIsa::widest)
}

/// Lanes of [`dot_abs_on`]'s partial sums.
const L: usize = 8;

/// Partial sums of a lane each: `(dot, abs)`.
type Lanes = ([f64; L], [f64; L]);

/// `(Σ aᵢ·bᵢ, Σ |aᵢ·bᵢ|)` over the common length of `a` and `b`, in f64: eight
/// interleaved partial sums (eight lanes: one AVX-512 vector or two AVX2 ones of
/// independent adds, on the vector path `isa`), added pairwise at the end.
/// The products are exact for the values compared here (bf16 times bf16, or times an fp8
/// code and its f32 scale), so only the sums round, at f64's 2^-53; whether a sum is NaN
/// or infinite does not depend on the order.
///
/// Each lane does the same operations in the same order on every path, so the bits are
/// the same (this module's tests). The references' hottest loop: over a quarter of
/// `sparsekit repro`'s time as LLVM compiled it for SSE2, before it ran in explicit
/// vectors and then several chains side by side ([`dot_abs_each`]).
fn dot_abs_on(isa: CpuIsa, a: &[f64], b: &[f64]) -> (f64, f64) {
    let n = a.len().min(b.len());
    // Whole chunks of L, then the rest.
    let m = n - n % L;
    if m == n {
        let [sums] = sums_on(isa, &a[..n], [&b[..n]]);
        return sums;
    }
    let [lanes] = lanes_on(isa, &a[..m], [&b[..m]]);
    finish(lanes, &a[m..n], &b[m..n])
}

/// Adds the products of the rest `ar`, `br` (fewer than L elements) to lanes `0..`, then
/// the lanes pairwise.
fn finish((mut dot, mut abs): Lanes, ar: &[f64], br: &[f64]) -> (f64, f64) {
    for (l, (x, y)) in ar.iter().zip(br).enumerate() {
        let p = x * y;
        dot[l] += p;
        abs[l] += p.abs();
    }
    let pairwise = |v: [f64; L]| ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
    (pairwise(dot), pairwise(abs))
}

/// `f(i, (Σ x·yᵢ, Σ |x·yᵢ|))` for each `yᵢ` of `ys`, in order, on the widest vector path
/// of this CPU ([`CpuIsa::widest`], whatever path the kernels are forced to): the bits of
/// [`dot_abs_on`] on any path. Up to [`GROUP`] of the `y`s run side by side, so that their
/// chains of adds overlap (one key against a row's heads, one query against a token's
/// keys).
pub(crate) fn dot_abs_each<'y>(
    x: &[f64],
    ys: impl IntoIterator<Item = &'y [f64]>,
    f: impl FnMut(usize, (f64, f64)),
) {
    dot_abs_each_on(widest(), x, ys, f)
}

/// The `y`s [`dot_abs_each`] runs side by side.
const GROUP: usize = 4;

/// [`dot_abs_each`] on the vector path `isa`.
fn dot_abs_each_on<'y>(
    isa: CpuIsa,
    x: &[f64],
    ys: impl IntoIterator<Item = &'y [f64]>,
    mut f: impl FnMut(usize, (f64, f64)),
) {
    let mut group: [&[f64]; GROUP] = [&[]; GROUP];
    let (mut len, mut first) = (0, 0);
    for y in ys {
        group[len] = y;
        len += 1;
        if len == GROUP {
            for (j, r) in dot_abs_group(isa, x, group).into_iter().enumerate() {
                f(first + j, r);
            }
            (len, first) = (0, first + GROUP);
        }
    }
    for (j, y) in group[..len].iter().enumerate() {
        f(first + j, dot_abs_on(isa, x, y));
    }
}

/// [`dot_abs_on`] of `x` with each of `ys` (one at a time where their lengths differ).
fn dot_abs_group(isa: CpuIsa, x: &[f64], ys: [&[f64]; GROUP]) -> [(f64, f64); GROUP] {
    let n = x.len();
    if ys.iter().any(|y| y.len() != n) {
        return ys.map(|y| dot_abs_on(isa, x, y));
    }
    let m = n - n % L;
    let (xc, yc) = (&x[..m], ys.map(|y| &y[..m]));
    if m == n {
        return sums_on(isa, xc, yc);
    }
    let lanes = lanes_on(isa, xc, yc);
    std::array::from_fn(|i| finish(lanes[i], &x[m..], &ys[i][m..]))
}

/// [`finish`] of [`lanes_on`] with no rest: on the vector paths the lanes are added
/// pairwise in registers (the same adds, operands in the same order: the same bits),
/// not stored and added one by one.
fn sums_on<const N: usize>(isa: CpuIsa, xc: &[f64], yc: [&[f64]; N]) -> [(f64, f64); N] {
    assert!(xc.len() % L == 0 && yc.iter().all(|y| y.len() == xc.len()));
    match isa.isa() {
        // SAFETY: as in `lanes_on`: AVX-512F on the AVX-512 paths; the slices as asserted.
        #[cfg(target_arch = "x86_64")]
        Isa::Amx | Isa::Avx512Bf16 | Isa::Avx512 => unsafe { x86::sums_avx512(xc, yc) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => two_at_a_time(
            yc,
            (0.0, 0.0),
            // SAFETY: as above: AVX2 on the avx2 path.
            |a, b| unsafe { x86::sums_avx2(xc, [a, b]) },
            // SAFETY: as above.
            |a| unsafe { x86::sums_avx2(xc, [a]) },
        ),
        _ => lanes(xc, yc).map(|l| finish(l, &[], &[])),
    }
}

/// `pair` over the `y`s of `yc` two at a time, `one` over the last of an odd count: the
/// AVX2 loops (four `y`s' sixteen accumulators would fill all the AVX2 registers).
#[cfg(target_arch = "x86_64")]
fn two_at_a_time<'y, T: Copy, const N: usize>(
    yc: [&'y [f64]; N],
    zero: T,
    pair: impl Fn(&'y [f64], &'y [f64]) -> [T; 2],
    one: impl Fn(&'y [f64]) -> [T; 1],
) -> [T; N] {
    let mut out = [zero; N];
    for (o, ys) in out.chunks_mut(2).zip(yc.chunks(2)) {
        match *ys {
            [a, b] => o.copy_from_slice(&pair(a, b)),
            _ => o.copy_from_slice(&one(ys[0])),
        }
    }
    out
}

/// [`lanes`] on the vector path `isa` (every slice of `yc` as long as `xc`, a multiple
/// of L).
fn lanes_on<const N: usize>(isa: CpuIsa, xc: &[f64], yc: [&[f64]; N]) -> [Lanes; N] {
    assert!(xc.len() % L == 0 && yc.iter().all(|y| y.len() == xc.len()));
    match isa.isa() {
        // SAFETY: a `CpuIsa` names only a path this CPU supports (checked when it was
        // made): AVX-512F on the AVX-512 paths. The slices are as asserted above.
        #[cfg(target_arch = "x86_64")]
        Isa::Amx | Isa::Avx512Bf16 | Isa::Avx512 => unsafe { x86::lanes_avx512(xc, yc) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => two_at_a_time(
            yc,
            ([0.0; L], [0.0; L]),
            // SAFETY: as above: AVX2 on the avx2 path.
            |a, b| unsafe { x86::lanes_avx2(xc, [a, b]) },
            // SAFETY: as above.
            |a| unsafe { x86::lanes_avx2(xc, [a]) },
        ),
        _ => lanes(xc, yc),
    }
}

/// Lane `l` of each result: `(Σ x[l]·y[l], Σ |x[l]·y[l]|)` over the chunks of L of `xc`
/// and of each `y` of `yc` (all of `xc`'s length, a multiple of L), in order.
fn lanes<const N: usize>(xc: &[f64], yc: [&[f64]; N]) -> [Lanes; N] {
    let mut out = [([0.0f64; L], [0.0f64; L]); N];
    for (c, x) in xc.chunks_exact(L).enumerate() {
        for ((dot, abs), y) in out.iter_mut().zip(&yc) {
            let y = &y[c * L..][..L];
            for l in 0..L {
                let p = x[l] * y[l];
                dot[l] += p;
                abs[l] += p.abs();
            }
        }
    }
    out
}

/// [`lanes`] in explicit vectors (LLVM's own vectorisation of it mixed scalar adds and
/// shuffles in): the same operations on each lane.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Lanes, L};
    use std::arch::x86_64::*;

    /// A vector at any address: the same bytes, aligned to 1.
    #[repr(C, packed)]
    #[derive(Clone, Copy)]
    struct Unaligned<T: Copy>(T);

    /// The vector at `p`, which need not be aligned. Not `_mm*_loadu_pd`: with debug
    /// assertions (the tests' build) they copy through a temporary whose address their
    /// overlap check compares, and the loop then ran through memory (as in the host
    /// crate's `cpu::raw`).
    ///
    /// # Safety
    /// `p` points at `size_of::<T>()` readable bytes that hold a valid `T` (any bits, for
    /// the vectors read here).
    #[inline(always)]
    unsafe fn load<T: Copy>(p: *const f64) -> T {
        // SAFETY: the caller's contract; the field is copied out by value.
        unsafe { (*p.cast::<Unaligned<T>>()).0 }
    }

    /// The accumulators of [`lanes_avx512`]: each `y`'s eight lanes of `x·y` and of
    /// `|x·y|`, over the chunks of 8 in order.
    ///
    /// # Safety
    /// The CPU has AVX-512F; every slice of `yc` holds `xc.len()` elements, a multiple of
    /// L.
    #[allow(
        clippy::incompatible_msrv,
        reason = "AVX-512 needs Rust 1.89, as the host crate's AVX-512 target features do"
    )]
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn acc_avx512<const N: usize>(
        xc: &[f64],
        yc: [&[f64]; N],
    ) -> ([__m512d; N], [__m512d; N]) {
        let (mut dot, mut abs) = ([_mm512_setzero_pd(); N], [_mm512_setzero_pd(); N]);
        for (c, x) in xc.chunks_exact(L).enumerate() {
            // SAFETY: `x` holds 8 f64: one unaligned vector.
            let xv: __m512d = unsafe { load(x.as_ptr()) };
            for i in 0..N {
                // SAFETY: chunk `c` of `yc[i]`, as long as `xc` (the caller's contract).
                let p = _mm512_mul_pd(xv, unsafe { load(yc[i].as_ptr().add(c * L)) });
                dot[i] = _mm512_add_pd(dot[i], p);
                abs[i] = _mm512_add_pd(abs[i], _mm512_abs_pd(p));
            }
        }
        (dot, abs)
    }

    /// # Safety
    /// As [`acc_avx512`].
    #[allow(
        clippy::incompatible_msrv,
        reason = "AVX-512 needs Rust 1.89, as the host crate's AVX-512 target features do"
    )]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn lanes_avx512<const N: usize>(xc: &[f64], yc: [&[f64]; N]) -> [Lanes; N] {
        // SAFETY: the caller's contract.
        let (dot, abs) = unsafe { acc_avx512(xc, yc) };
        let mut out = [([0.0; L], [0.0; L]); N];
        for ((d, a), i) in out.iter_mut().zip(0..N) {
            // SAFETY: `d` and `a` are arrays of 8 f64.
            unsafe {
                _mm512_storeu_pd(d.as_mut_ptr(), dot[i]);
                _mm512_storeu_pd(a.as_mut_ptr(), abs[i]);
            }
        }
        out
    }

    /// [`lanes_avx512`] with each `y`'s lanes added pairwise in registers.
    ///
    /// # Safety
    /// As [`acc_avx512`].
    #[allow(
        clippy::incompatible_msrv,
        reason = "AVX-512 needs Rust 1.89, as the host crate's AVX-512 target features do"
    )]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn sums_avx512<const N: usize>(
        xc: &[f64],
        yc: [&[f64]; N],
    ) -> [(f64, f64); N] {
        // SAFETY: the caller's contract.
        let (dot, abs) = unsafe { acc_avx512(xc, yc) };
        let mut out = [(0.0, 0.0); N];
        for (o, i) in out.iter_mut().zip(0..N) {
            // SAFETY: AVX-512F, as this function's caller ensures.
            *o = unsafe { (pairwise512(dot[i]), pairwise512(abs[i])) };
        }
        out
    }

    /// `((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7))` of `v`'s lanes, each add with
    /// [`super::finish`]'s operands in its order: lane 2j of the first sum is `v2j +
    /// v2j+1`, lane 4j of the second `(v4j + v4j+1) + (v4j+2 + v4j+3)`, then lane 0 plus
    /// lane 4. (A function, not a closure: a closure would not get the target feature,
    /// and its intrinsics would be calls.)
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[allow(
        clippy::incompatible_msrv,
        reason = "AVX-512 needs Rust 1.89, as the host crate's AVX-512 target features do"
    )]
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn pairwise512(v: __m512d) -> f64 {
        let s = _mm512_add_pd(v, _mm512_permute_pd::<0b0101_0101>(v));
        let s = _mm512_add_pd(s, _mm512_permutex_pd::<0b00_00_11_10>(s));
        let lo = _mm_cvtsd_f64(_mm512_castpd512_pd128(s));
        let hi = _mm_cvtsd_f64(_mm256_castpd256_pd128(_mm512_extractf64x4_pd::<1>(s)));
        lo + hi
    }

    /// The accumulators of [`lanes_avx2`] (each lane of 8 as half `h` of a pair).
    ///
    /// # Safety
    /// The CPU has AVX2 (AVX for these operations); the slices as in [`acc_avx512`].
    #[target_feature(enable = "avx2")]
    #[inline]
    #[allow(clippy::type_complexity, reason = "two arrays of vector pairs")]
    unsafe fn acc_avx2<const N: usize>(
        xc: &[f64],
        yc: [&[f64]; N],
    ) -> ([[__m256d; 2]; N], [[__m256d; 2]; N]) {
        let zero = _mm256_setzero_pd();
        let (mut dot, mut abs) = ([[zero; 2]; N], [[zero; 2]; N]);
        // Clears the sign bit: |p|.
        let magnitude = _mm256_castsi256_pd(_mm256_set1_epi64x(i64::MAX));
        for (c, x) in xc.chunks_exact(L).enumerate() {
            for h in 0..2 {
                // SAFETY: lanes `4h .. 4h + 4` of a chunk of 8 f64.
                let xv: __m256d = unsafe { load(x.as_ptr().add(4 * h)) };
                for i in 0..N {
                    // SAFETY: lanes `4h .. 4h + 4` of chunk `c` of `yc[i]`, as long as `xc`
                    // (the caller's contract).
                    let yv: __m256d = unsafe { load(yc[i].as_ptr().add(c * L + 4 * h)) };
                    let p = _mm256_mul_pd(xv, yv);
                    dot[i][h] = _mm256_add_pd(dot[i][h], p);
                    abs[i][h] = _mm256_add_pd(abs[i][h], _mm256_and_pd(p, magnitude));
                }
            }
        }
        (dot, abs)
    }

    /// # Safety
    /// As [`acc_avx2`].
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn lanes_avx2<const N: usize>(xc: &[f64], yc: [&[f64]; N]) -> [Lanes; N] {
        // SAFETY: the caller's contract.
        let (dot, abs) = unsafe { acc_avx2(xc, yc) };
        let mut out = [([0.0; L], [0.0; L]); N];
        for ((d, a), i) in out.iter_mut().zip(0..N) {
            for h in 0..2 {
                // SAFETY: lanes `4h .. 4h + 4` of arrays of 8 f64.
                unsafe {
                    _mm256_storeu_pd(d.as_mut_ptr().add(4 * h), dot[i][h]);
                    _mm256_storeu_pd(a.as_mut_ptr().add(4 * h), abs[i][h]);
                }
            }
        }
        out
    }

    /// [`lanes_avx2`] with each `y`'s lanes added pairwise in registers.
    ///
    /// # Safety
    /// As [`acc_avx2`].
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn sums_avx2<const N: usize>(xc: &[f64], yc: [&[f64]; N]) -> [(f64, f64); N] {
        // SAFETY: the caller's contract.
        let (dot, abs) = unsafe { acc_avx2(xc, yc) };
        let mut out = [(0.0, 0.0); N];
        for (o, i) in out.iter_mut().zip(0..N) {
            let [d0, d1] = dot[i];
            let [a0, a1] = abs[i];
            // SAFETY: AVX2, as this function's caller ensures.
            *o = unsafe { (pairwise4(d0) + pairwise4(d1), pairwise4(a0) + pairwise4(a1)) };
        }
        out
    }

    /// `(v0 + v1) + (v2 + v3)` of `v`'s lanes as in [`pairwise512`] (lane 0 of the first
    /// sum is `v0 + v1`, lane 2 `v2 + v3`): the halves of [`super::finish`]'s sum.
    ///
    /// # Safety
    /// The CPU has AVX2 (AVX for these operations).
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn pairwise4(v: __m256d) -> f64 {
        let s = _mm256_add_pd(v, _mm256_permute_pd::<0b0101>(v));
        let lo = _mm_cvtsd_f64(_mm256_castpd256_pd128(s));
        let hi = _mm_cvtsd_f64(_mm256_extractf128_pd::<1>(s));
        lo + hi
    }
}

/// Reference indexer output for one row: `(logit, magnitude)` per column of the row
/// (`-inf`, 0 outside its range). `magnitude = Σ_h |w_h| · (Σ_d |q_hd · k_d| + flush) ·
/// scale` bounds the rounding error of any f32 evaluation (`flush`: the bf16 dot product's
/// subnormal flushes, [`crate::tolerance::dot_flush_magnitude`] of `d + 1` steps).
#[derive(Debug)]
pub struct IndexerRef {
    pub logits: Vec<f64>,
    pub magnitude: Vec<f64>,
}

/// Reference `indexer_logits` over all rows (parallel over rows; naive inside).
#[allow(clippy::too_many_arguments)]
pub fn indexer_logits(
    layout: &IndexKLayout,
    cache: &[u8],
    page_table: &PageTable<'_>,
    rows: &[QueryRange],
    n_heads: usize,
    q: &[bf16],
    weights: &[f32],
    row_stride: usize,
) -> IndexerRef {
    let d = layout.head_dim();
    let flush = crate::tolerance::dot_flush_magnitude(d + 1, crate::tolerance::INDEXER_ATOL);
    let per_row: Vec<(Vec<f64>, Vec<f64>)> = rows
        .par_iter()
        .enumerate()
        .map(|(r, range)| {
            let mut logits = vec![f64::NEG_INFINITY; row_stride];
            let mut mag = vec![0.0; row_stride];
            // The row's queries in f64 once (exact), not once per key.
            let qr = bf16_f64s(&q[r * n_heads * d..(r + 1) * n_heads * d]);
            let wr = &weights[r * n_heads..(r + 1) * n_heads];
            let mut k = Vec::with_capacity(d);
            for pos in range.start as usize..range.end as usize {
                let slot = page_table.slot(range.request as usize, pos, layout.page_size());
                let s = read_index_key_into(layout, cache, slot, &mut k);
                let (mut acc, mut m) = (0.0, 0.0);
                // The key against each head's query, heads in order.
                dot_abs_each(&k, qr.chunks_exact(d), |h, (dot, adot)| {
                    // ReLU as `fmax`: a NaN dot counts as 0 (as on every backend).
                    acc += wr[h] as f64 * dot.max(0.0);
                    // A non-finite dot is exact after the ReLU (0) or makes the logit
                    // non-finite (compared exactly): no rounding error to scale.
                    if dot.is_finite() {
                        m += (wr[h] as f64).abs() * (adot + flush);
                    }
                });
                logits[pos] = acc * s;
                mag[pos] = m * s;
            }
            (logits, mag)
        })
        .collect();
    let mut out = IndexerRef {
        logits: Vec::with_capacity(rows.len() * row_stride),
        magnitude: Vec::with_capacity(rows.len() * row_stride),
    };
    for (l, m) in per_row {
        out.logits.extend(l);
        out.magnitude.extend(m);
    }
    out
}

/// Reference top-k of one row: positions (relative to the row) of the `k` largest valid
/// entries (not `-inf`, not NaN), ties to the lower position, returned in ascending order.
pub fn topk_row(row: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..row.len())
        .filter(|&i| !row[i].is_nan() && row[i] != f32::NEG_INFINITY)
        .collect();
    // Larger first, ties to the lower position: a total order (positions differ), so the
    // first `k` after a selection are the first `k` of a full sort.
    let order = |&a: &usize, &b: &usize| {
        row[b]
            .partial_cmp(&row[a])
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.cmp(&b))
    };
    if k == 0 {
        return Vec::new();
    }
    if idx.len() > k {
        idx.select_nth_unstable_by(k - 1, order);
        idx.truncate(k);
    }
    idx.sort_unstable();
    idx
}

/// Reference of DeepSeek-V4's top-k transform over one row (its range): a row of at most
/// `k` positions takes all of them in order, whatever their logits; a longer one its
/// [`topk_row`].
pub fn topk_transform(row: &[f32], k: usize) -> Vec<usize> {
    if row.len() <= k {
        (0..row.len()).collect()
    } else {
        topk_row(row, k)
    }
}

/// Reference sparse MLA: per element and head, the f64 result and the inputs of its error
/// scales (see [`crate::tolerance::mla_out_magnitude`] for how they make the bound).
#[derive(Debug)]
pub struct MlaRef {
    /// `[n_tokens, n_heads, d_v]`.
    pub out: Vec<f64>,
    /// `[n_tokens, n_heads]`, natural log.
    pub lse: Vec<f64>,
    /// `A = Σ_j w_j·|v_jc|` per output element: the softmax-weighted mean of the absolute
    /// values its sum is made of (the scale of every error in the weights).
    pub out_abs: Vec<f64>,
    /// `softmax_scale · (max_j Σ_d |q_d·k_jd| + flush)` per head: bounds the score rounding
    /// error (`flush`: the bf16 dot product's, [`crate::tolerance::dot_flush_magnitude`]).
    pub lse_magnitude: Vec<f64>,
    /// Valid slots per token (duplicates counted).
    pub n_valid: Vec<usize>,
    /// Largest |latent| over each token's valid slots.
    pub v_max: Vec<f64>,
    pub n_heads: usize,
    pub d_v: usize,
    /// Multiplies `lse_magnitude` in the `out` bound: 1, or 1.5 for `sparse_mla_v4`, whose
    /// sink factor `1 / (1 + e^(sink − lse))` moves by at most the lse's error `E`
    /// (relative): one more `E` on top of the weights' `2E` (`out_abs` already holds the
    /// factor).
    pub score_slack: f64,
}

impl MlaRef {
    /// The tolerance magnitude of output element `i` (row-major `[token, head, d_v]`):
    /// [`crate::tolerance::mla_out_magnitude`] of its `A`, its head's score scale and its
    /// token's slot count.
    pub fn out_magnitude(&self, i: usize) -> f64 {
        self.head_scale(i / self.d_v).of(self.out_abs[i])
    }

    /// [`MlaRef::out_magnitude`] of every output element in order (the same bits), each
    /// head's shared terms computed once rather than per element.
    pub fn out_magnitudes(&self) -> impl Iterator<Item = f64> + '_ {
        self.out_abs
            .chunks(self.d_v.max(1))
            .enumerate()
            .flat_map(move |(head, abs)| {
                let s = self.head_scale(head);
                abs.iter().map(move |&a| s.of(a))
            })
    }

    /// The terms of head `head`'s (row-major `[token, head]`) bound.
    fn head_scale(&self, head: usize) -> crate::tolerance::MlaOutScale {
        let token = head / self.n_heads;
        crate::tolerance::MlaOutScale::new(
            self.score_slack * self.lse_magnitude[head],
            self.n_valid[token],
            self.v_max[token],
        )
    }
}

/// Reference `sparse_mla` for all tokens (parallel over tokens; naive inside).
#[allow(clippy::too_many_arguments)]
pub fn sparse_mla(
    layout: &KvLayout,
    cache: &[u8],
    q: &[bf16],
    indices: &[i32],
    n_tokens: usize,
    n_heads: usize,
    topk: usize,
    softmax_scale: f32,
) -> MlaRef {
    let (dqk, dv) = (layout.d_qk(), layout.nope_dim());
    let scale = softmax_scale as f64;
    let flush = crate::tolerance::dot_flush_magnitude(dqk + 1, crate::tolerance::MLA_LSE_ATOL);
    type TokenRef = (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, usize, f64);
    let per_token: Vec<TokenRef> = (0..n_tokens)
        .into_par_iter()
        .map(|t| {
            let keys: Vec<Vec<f64>> = indices[t * topk..(t + 1) * topk]
                .iter()
                .filter(|&&i| i >= 0)
                .map(|&i| read_kv_token(layout, cache, i as usize))
                .collect();
            let vmax = keys
                .iter()
                .flat_map(|k| k[..dv].iter())
                .fold(0.0f64, |m, x| m.max(x.abs()));
            let mut out = vec![0.0; n_heads * dv];
            let mut abs = vec![0.0; n_heads * dv];
            let mut lse = vec![f64::NEG_INFINITY; n_heads];
            let mut lmag = vec![0.0; n_heads];
            for h in 0..n_heads {
                let qh = bf16_f64s(&q[(t * n_heads + h) * dqk..(t * n_heads + h + 1) * dqk]);
                let mut scores = Vec::with_capacity(keys.len());
                dot_abs_each(&qh, keys.iter().map(Vec::as_slice), |_, (dot, adot)| {
                    scores.push(dot * scale);
                    lmag[h] = f64::max(lmag[h], (adot + flush) * scale.abs());
                });
                if keys.is_empty() {
                    continue;
                }
                let mx = scores.iter().fold(f64::NEG_INFINITY, |m, &s| m.max(s));
                let w: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
                let sum: f64 = w.iter().sum();
                lse[h] = mx + sum.ln();
                let o = &mut out[h * dv..(h + 1) * dv];
                let a = &mut abs[h * dv..(h + 1) * dv];
                for (wj, k) in w.iter().zip(&keys) {
                    // `wj / sum · v` (times 1: the same bits).
                    weigh_into(o, a, &k[..dv], wj / sum, 1.0);
                }
            }
            (out, lse, abs, lmag, keys.len(), vmax)
        })
        .collect();
    let mut r = MlaRef {
        out: Vec::new(),
        lse: Vec::new(),
        out_abs: Vec::new(),
        lse_magnitude: Vec::new(),
        n_valid: Vec::new(),
        v_max: Vec::new(),
        n_heads,
        d_v: dv,
        score_slack: 1.0,
    };
    for (o, l, a, lm, n, vm) in per_token {
        r.v_max.push(vm);
        r.out.extend(o);
        r.lse.extend(l);
        r.out_abs.extend(a);
        r.lse_magnitude.extend(lm);
        r.n_valid.push(n);
    }
    r
}

/// Reference page copy over whole buffers (regions validated by the caller).
pub fn copy_pages(
    src_region: &sparsekit_host::ops::PagedRegion,
    dst_region: &sparsekit_host::ops::PagedRegion,
    src: &[u8],
    dst: &mut [u8],
    src_ids: &[i32],
    dst_ids: &[i32],
) {
    for (&s, &d) in src_ids.iter().zip(dst_ids) {
        let from = src_region.page_range(s as usize);
        let to = dst_region.page_range(d as usize);
        for (i, j) in from.zip(to) {
            dst[j] = src[i];
        }
    }
}

/// Reference page checksum, written from the definition in
/// `sparsekit_kernels::checksum` with 128-bit arithmetic reduced mod 2^64.
pub fn page_checksum(page: &[u8]) -> u64 {
    fn mix(z: u64) -> u64 {
        let m = |a: u64, k: u64| ((a as u128 * k as u128) % (1u128 << 64)) as u64;
        let z = m(z ^ (z >> 30), 0xBF58_476D_1CE4_E5B9);
        let z = m(z ^ (z >> 27), 0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    let mut sum: u128 = 0;
    for (i, chunk) in page.chunks(8).enumerate() {
        let mut word = 0u64;
        for (b, &byte) in chunk.iter().enumerate() {
            word |= (byte as u64) << (8 * b);
        }
        let phi = ((i as u128 * 0x9E37_79B9_7F4A_7C15u128) % (1u128 << 64)) as u64;
        sum = (sum + mix(word ^ phi) as u128) % (1u128 << 64);
    }
    mix(sum as u64 ^ page.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_abs_has_the_same_bits_on_every_vector_path() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for n in [0, 1, 7, 8, 9, 63, 64, 65, 128, 513] {
            // Magnitudes over many binades (the order of the adds shows in the bits) or
            // few (so does the rounding of each product).
            let mut v = || -> Vec<f64> {
                let e = if rng.gen_bool(0.5) { 30 } else { 2 };
                (0..n)
                    .map(|_| rng.gen_range(-1.0..1.0) * 2f64.powi(rng.gen_range(-e..e)))
                    .collect()
            };
            let (a, b) = (v(), v());
            let want = dot_abs_on(CpuIsa::SCALAR, &a, &b);
            assert!(want.0.is_finite() && want.1 >= want.0.abs(), "{want:?}");
            for isa in CpuIsa::available() {
                let got = dot_abs_on(isa, &a, &b);
                assert_eq!(
                    (got.0.to_bits(), got.1.to_bits()),
                    (want.0.to_bits(), want.1.to_bits()),
                    "{isa:?}, n = {n}"
                );
            }
            // A NaN anywhere gives a NaN sum on every path.
            if n > 0 {
                let mut a = a.clone();
                a[n / 2] = f64::NAN;
                for isa in CpuIsa::available() {
                    assert!(dot_abs_on(isa, &a, &b).0.is_nan(), "{isa:?}, n = {n}");
                }
            }
        }
    }

    #[test]
    fn dot_abs_each_has_the_bits_of_one_pair_at_a_time() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        // Magnitudes over many binades (the order of the adds shows in the bits) or few
        // (so does the rounding of each product).
        let mut v = |n: usize| -> Vec<f64> {
            let e = if rng.gen_bool(0.5) { 30 } else { 2 };
            (0..n)
                .map(|_| rng.gen_range(-1.0..1.0) * 2f64.powi(rng.gen_range(-e..e)))
                .collect()
        };
        // Every count of `y`s around a whole group, lengths with and without a rest,
        // and groups with one `y` of another length (taken one at a time).
        for (n, count, odd) in [(64, 9, None), (67, 4, None), (5, 7, None), (576, 5, None)]
            .into_iter()
            .chain([(72, 8, Some(2)), (33, 4, Some(0)), (0, 3, None)])
        {
            let x = v(n);
            let mut ys: Vec<Vec<f64>> = (0..count).map(|_| v(n)).collect();
            if let Some(i) = odd {
                ys[i] = v(n + 9);
            }
            // A NaN in one `y` stays in its own result.
            if n > 0 {
                ys[count - 1][n / 3] = f64::NAN;
            }
            let want: Vec<(f64, f64)> = ys
                .iter()
                .map(|y| dot_abs_on(CpuIsa::SCALAR, &x, y))
                .collect();
            for isa in CpuIsa::available() {
                let mut got = Vec::new();
                dot_abs_each_on(isa, &x, ys.iter().map(Vec::as_slice), |i, r| {
                    assert_eq!(i, got.len(), "{isa:?}: in order");
                    got.push(r);
                });
                assert_eq!(got.len(), count);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    if n > 0 && i == count - 1 {
                        assert!(g.0.is_nan() && w.0.is_nan(), "{isa:?}, n = {n}, y {i}");
                        continue;
                    }
                    assert!(w.0.is_finite() || n == 0, "{w:?}");
                    assert_eq!(
                        (g.0.to_bits(), g.1.to_bits()),
                        (w.0.to_bits(), w.1.to_bits()),
                        "{isa:?}, n = {n}, y {i} of {count}"
                    );
                }
            }
        }
    }

    #[test]
    fn weigh_into_has_the_same_bits_on_every_vector_path() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for n in [1, 7, 8, 13, 64, 513] {
            let mut v = || -> Vec<f64> {
                (0..n)
                    .map(|_| rng.gen_range(-1.0..1.0) * 2f64.powi(rng.gen_range(-20..20)))
                    .collect()
            };
            let (o, a, x) = (v(), v(), v());
            let c = rng.gen_range(0.0..1.0);
            // Both loops: f = 1 and f ≥ 0 (the product taken once), a negative weight.
            for (c, f) in [(c, 1.0), (c, rng.gen_range(0.5..1.0)), (-c, 0.75)] {
                let want: Vec<(u64, u64)> = (0..n)
                    .map(|i| {
                        (
                            (o[i] + c * x[i] * f).to_bits(),
                            (a[i] + c * x[i].abs() * f).to_bits(),
                        )
                    })
                    .collect();
                for isa in CpuIsa::available() {
                    let (mut o, mut a) = (o.clone(), a.clone());
                    weigh_into_on(isa, &mut o, &mut a, &x, c, f);
                    let got: Vec<(u64, u64)> = o
                        .iter()
                        .zip(&a)
                        .map(|(o, a)| (o.to_bits(), a.to_bits()))
                        .collect();
                    assert_eq!(got, want, "{isa:?}, n = {n}, c = {c}, f = {f}");
                }
            }
        }
    }

    #[test]
    fn out_magnitudes_have_the_bits_of_out_magnitude() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        let (tokens, heads, dv) = (3, 5, 7);
        let mut v = |n: usize| -> Vec<f64> {
            (0..n)
                .map(|_| rng.gen_range(0.0..4.0) * 2f64.powi(rng.gen_range(-30..10)))
                .collect()
        };
        let r = MlaRef {
            out: v(tokens * heads * dv),
            lse: v(tokens * heads),
            out_abs: v(tokens * heads * dv),
            lse_magnitude: v(tokens * heads),
            n_valid: vec![0, 17, 2048],
            v_max: v(tokens),
            n_heads: heads,
            d_v: dv,
            score_slack: 1.5,
        };
        let each: Vec<u64> = (0..r.out.len())
            .map(|i| r.out_magnitude(i).to_bits())
            .collect();
        let all: Vec<u64> = r.out_magnitudes().map(f64::to_bits).collect();
        assert_eq!(all, each);
        // And the formula itself, for one element of each token.
        for t in 0..tokens {
            let (i, head) = (t * heads * dv + 3, t * heads);
            let want = crate::tolerance::mla_out_magnitude(
                r.out_abs[i],
                1.5 * r.lse_magnitude[head],
                r.n_valid[t],
                r.v_max[t],
            );
            assert_eq!(r.out_magnitude(i).to_bits(), want.to_bits());
        }
    }

    #[test]
    fn bf16s_into_has_the_bits_of_the_scalar_widening_on_every_path() {
        // Every bf16 bit pattern (NaNs, infinities, subnormals, both zeros), shuffled.
        use rand::seq::SliceRandom;
        use rand::SeedableRng;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        let mut bits: Vec<u16> = (0..=u16::MAX).collect();
        bits.shuffle(&mut rng);
        let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
        let want: Vec<u64> = bits
            .iter()
            .map(|&b| (f32::from_bits((b as u32) << 16) as f64).to_bits())
            .collect();
        for isa in CpuIsa::available() {
            // Odd lengths and offsets: the vector loops' tails.
            for (at, n) in [(0, bits.len()), (1, 13), (5, 1000)] {
                let mut out = vec![f64::NAN; n];
                bf16s_into_on(isa, &bytes[2 * at..2 * (at + n)], &mut out);
                let got: Vec<u64> = out.iter().map(|x| x.to_bits()).collect();
                assert_eq!(got, want[at..at + n], "{isa:?}, at {at}, n {n}");
            }
        }
        let mut ext = vec![1.0];
        extend_bf16s(&mut ext, &bytes, 3);
        assert_eq!(ext[0], 1.0);
        assert_eq!(
            ext[1..].iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            want[..3]
        );
    }

    #[test]
    fn topk_row_selects_what_a_full_sort_keeps() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for _ in 0..200 {
            let n = rng.gen_range(0..300);
            // Few distinct values, so ties are everywhere; both zeros, NaN and ±inf too.
            let pool = [
                1.5,
                -2.0,
                0.0,
                -0.0,
                7.25,
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::NAN,
            ];
            let row: Vec<f32> = (0..n).map(|_| pool[rng.gen_range(0..pool.len())]).collect();
            let k = rng.gen_range(0..n + 3);
            let mut want: Vec<usize> = (0..n)
                .filter(|&i| !row[i].is_nan() && row[i] != f32::NEG_INFINITY)
                .collect();
            want.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap().then(a.cmp(&b)));
            want.truncate(k);
            want.sort_unstable();
            assert_eq!(topk_row(&row, k), want, "n = {n}, k = {k}, {row:?}");
        }
    }

    #[test]
    fn reference_codec_agrees_with_library_on_all_codes_and_midpoints() {
        for c in 0u8..=255 {
            let v = e4m3_value(c);
            let lib = sparsekit_host::dtype::e4m3_decode(c) as f64;
            assert!(v == lib || (v.is_nan() && lib.is_nan()), "code {c:#x}");
        }
        // Midpoints between consecutive codes exercise ties-to-even in both.
        let t = positive_values();
        for i in 0..126 {
            let mid = (t[i] + t[i + 1]) / 2.0;
            let lib = sparsekit_host::dtype::e4m3_encode(mid as f32);
            assert_eq!(e4m3_encode(mid), lib, "midpoint {mid}");
            assert_eq!(e4m3_encode(-mid), lib | 0x80);
        }
    }
}
