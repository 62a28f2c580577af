//! Cache rows widened for the kernels, the same bits on every vector path (this module's tests):
//! - to bf16 bits for the `vdpbf16ps` and AMX kernels and the `avx512` path's keys-along
//!   attention: e4m3 codes times a power of two (exact: at most 4 significant bits) and fp4
//!   groups (e2m1 × the group's ue8m0 scale, exact while the products stay normal); on the
//!   AVX-512 paths by word table lookups
//!   (`vpermi2w`, `vpermw`: 32 values per instruction), elsewhere value by value;
//! - to f32 for the FMA kernels: e4m3 codes (through f16 and F16C on the AVX paths), fp4
//!   groups (an 8-entry `vpermps` table on the AVX paths) and bf16 values (subnormals
//!   flushed to signed zero, as `vdpbf16ps` reads them).
//!
//! On AVX-512 CPUs with VBMI (detected at run time, not a path of its own), e4m3 codes go
//! through two 128-entry byte tables instead (`vpermi2b`: 64 codes per lookup), the same
//! bits: to bf16 for the fp8 index keys and, a power-of-two scale added to the exponents,
//! for the KV caches' tiles (a row's tiles in one call, [`e4m3_tiles_pow2`]); to f32 on
//! the AVX-512 paths.

use sparsekit_kernels::fp8::decode_bits;
use sparsekit_kernels::mx::{e2m1_to_f32, ue8m0_to_f32};

use super::dot::{bf16_daz, e4m3_f32, f32_daz};
use super::isa::{CpuIsa, Isa};

/// bf16 bits of the fp4 code `n` (4 bits) times the scale of ue8m0 byte `sb`, a subnormal
/// product flushed to signed zero (what `vdpbf16ps` reads), NaN for scale byte `0xff`.
#[inline(always)]
pub fn fp4_bf16(n: u8, sb: u8) -> u16 {
    (f32_daz(e2m1_to_f32(n) * ue8m0_to_f32(sb)).to_bits() >> 16) as u16
}

/// The exponents `k` of the table routes of [`e4m3_row_pow2`] and [`e4m3_tiles_pow2`]:
/// nonzero e4m3 magnitudes span 2^-9 ..= 448, so their products with `2^k` stay normal
/// bf16 values and `k` can be added to the exponent field.
const TABLE_K: std::ops::RangeInclusive<i32> = -117..=119;

/// `out[i]` = the bf16 bits of `e4m3(codes[i]) · 2^k`, a subnormal product flushed to
/// signed zero — `f32_daz(e4m3_f32(c) · s)`'s top half for the power-of-two scale `s =
/// 2^k` (`k = 0`: the codes' own values) — on the vector path `isa`. Exact (every product
/// is a bf16 value).
pub fn e4m3_row_pow2(isa: CpuIsa, codes: &[u8], k: i32, out: &mut [u16]) {
    let n = codes.len().min(out.len());
    #[cfg(target_arch = "x86_64")]
    if isa.isa().avx512() && TABLE_K.contains(&k) {
        let done = if x86::has_vbmi() {
            let whole = n / 64 * 64;
            // SAFETY: AVX-512F/BW (the AVX-512 paths) and VBMI (checked); `whole` codes
            // and words, one tile of them, its `k` in range.
            unsafe { x86::e4m3_bf16_tiles_vbmi(&codes[..whole], whole, &[k], &mut out[..whole]) };
            whole
        } else {
            0
        };
        if done < n {
            // SAFETY: the AVX-512 paths exist only on a CPU with AVX-512F and AVX-512BW.
            unsafe { x86::e4m3_row(&codes[done..n], k, &mut out[done..n]) };
        }
        return;
    }
    let _ = isa;
    let s = 2f32.powi(k);
    for (x, &c) in out[..n].iter_mut().zip(&codes[..n]) {
        *x = (f32_daz(e4m3_f32(c) * s).to_bits() >> 16) as u16;
    }
}

/// [`e4m3_row_pow2`] of each tile of `tile` codes with its own exponent: tile `t` is
/// `codes[t·tile..(t + 1)·tile]` times `2^ks[t]`, into the same words of `out`. One call
/// for a cache row's tiles: on the AVX-512 paths with VBMI, tiles of whole vectors of
/// 64 and every `k` in -117..=119 go through the byte tables (loaded once per row, a
/// masked exponent add per vector); anything else tile by tile. Reads and writes the
/// first `tile · ks.len()` values; panics if `codes` or `out` is shorter.
pub fn e4m3_tiles_pow2(isa: CpuIsa, codes: &[u8], tile: usize, ks: &[i32], out: &mut [u16]) {
    let n = tile * ks.len();
    let (codes, out) = (&codes[..n], &mut out[..n]);
    #[cfg(target_arch = "x86_64")]
    if isa.isa().avx512()
        && tile % 64 == 0
        && x86::has_vbmi()
        && ks.iter().all(|k| TABLE_K.contains(k))
    {
        // SAFETY: AVX-512F/BW (the AVX-512 paths) and VBMI (checked); `n` codes and
        // words, tiles of whole vectors, every `k` in range.
        unsafe { x86::e4m3_bf16_tiles_vbmi(codes, tile, ks, out) };
        return;
    }
    if tile == 0 {
        return;
    }
    for ((c, o), &k) in codes
        .chunks_exact(tile)
        .zip(out.chunks_exact_mut(tile))
        .zip(ks)
    {
        e4m3_row_pow2(isa, c, k, o);
    }
}

/// `out[i] = e4m3_f32(codes[i])`: the codes' exact values as f32 (NaN for `0x7f`/`0xff`,
/// signed as [`e4m3_f32`]), on the vector path `isa`. The AVX paths go through f16: an
/// e4m3 code's fields moved into an f16's (exponent field 4 bits → 5, mantissa 3 → 10)
/// read as the value times 2^-8 — a subnormal code as an f16 subnormal, exactly — which
/// the F16C conversion widens and a multiply by 2^8 restores (exact, never subnormal);
/// about half the instructions of the arithmetic decode. The same bits on every path.
pub fn e4m3_f32_row(isa: CpuIsa, codes: &[u8], out: &mut [f32]) {
    let n = codes.len().min(out.len());
    let (codes, out) = (&codes[..n], &mut out[..n]);
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    match isa.isa() {
        Isa::Amx | Isa::Avx512Bf16 | Isa::Avx512 => {
            if x86::has_vbmi() {
                // SAFETY: AVX-512F/BW (the path's, `Isa::supported`) and VBMI (checked);
                // `codes` and `out` have the same length.
                done = unsafe { x86::e4m3_f32_row_vbmi(codes, out) };
            }
            // SAFETY: the path exists only on a CPU with AVX-512F, AVX-512BW and F16C
            // (`Isa::supported`); `codes` and `out` have the same length.
            done += unsafe { x86::e4m3_f32_row512(&codes[done..], &mut out[done..]) };
        }
        // SAFETY: as above, with AVX2 and F16C.
        Isa::Avx2 => done = unsafe { x86::e4m3_f32_row256(codes, out) },
        Isa::Scalar => {}
    }
    let _ = isa;
    for (x, &c) in out[done..].iter_mut().zip(&codes[done..]) {
        *x = e4m3_f32(c);
    }
}

/// `out[i]` = the f16 bits of `e4m3(codes[i]) · 2^-8`, exact for every code but NaN (an
/// e4m3 code's fields moved into an f16's: exponent field 4 bits → 5, mantissa 3 → 10; a
/// subnormal code becomes an f16 subnormal); returns whether a code is NaN (`0x7f`,
/// `0xff`; its output then is a finite value, not its own). Same bits on every path. For
/// kernels that widen the f16 as they load it (F16C: `vcvtph2ps`), with the `2^8` folded
/// into the other operand.
pub fn e4m3_f16_row(isa: CpuIsa, codes: &[u8], out: &mut [u16]) -> bool {
    let n = codes.len().min(out.len());
    let (codes, out) = (&codes[..n], &mut out[..n]);
    #[allow(unused_mut)]
    let (mut done, mut nan) = (0, false);
    #[cfg(target_arch = "x86_64")]
    match isa.isa() {
        Isa::Amx | Isa::Avx512Bf16 | Isa::Avx512 => {
            // SAFETY: the AVX-512 paths' CPU has AVX-512F and AVX-512BW
            // (`Isa::supported`); equal lengths.
            (done, nan) = unsafe { x86::e4m3_f16_row512(codes, out) }
        }
        // SAFETY: the avx2 path's CPU has AVX2 (`Isa::supported`); equal lengths.
        Isa::Avx2 => (done, nan) = unsafe { x86::e4m3_f16_row256(codes, out) },
        Isa::Scalar => {}
    }
    let _ = isa;
    for (x, &c) in out[done..].iter_mut().zip(&codes[done..]) {
        *x = e4m3_f16(c);
        nan |= c & 0x7f == 0x7f;
    }
    nan
}

/// The f16 bits of [`e4m3_f16_row`] for one code: its sign-extended byte shifted left by
/// 7 (magnitude to bits 7..14, sign to 15), bit 14 (the byte's sign, shifted) cleared.
#[inline(always)]
fn e4m3_f16(c: u8) -> u16 {
    ((c as i8 as i16 as u16) << 7) & 0xbfff
}

/// `out[i] = bf16_daz(bits)` of the little-endian bf16 in bytes `2i, 2i + 1` of `bytes`:
/// the value as f32, a subnormal flushed to signed zero (what `vdpbf16ps` reads), on the
/// vector path `isa`. The AVX paths flush in 16-bit lanes, then place each word in the high
/// half of a zeroed dword (AVX-512: one zero-masked `vpermw` per 16 values; AVX2: word
/// unpacks after a qword permute). Panics if `bytes` holds fewer than `2 · out.len()`.
pub fn bf16_f32_row(isa: CpuIsa, bytes: &[u8], out: &mut [f32]) {
    let bytes = &bytes[..2 * out.len()];
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    match isa.isa() {
        Isa::Amx | Isa::Avx512Bf16 | Isa::Avx512 => {
            // SAFETY: the path exists only on a CPU with AVX-512F and AVX-512BW
            // (`Isa::supported`); `bytes` holds `2 · out.len()` bytes (sliced above).
            done = unsafe { x86::bf16_f32_row512(bytes, out) }
        }
        // SAFETY: as above, with AVX2.
        Isa::Avx2 => done = unsafe { x86::bf16_f32_row256(bytes, out) },
        Isa::Scalar => {}
    }
    let _ = isa;
    for (x, b) in out[done..]
        .iter_mut()
        .zip(bytes[2 * done..].chunks_exact(2))
    {
        *x = bf16_daz(u16::from_le_bytes([b[0], b[1]]));
    }
}

/// [`bf16_f32_row`] of bf16 values in memory (`out[i] = bf16_daz(v[i])`); panics if `v`
/// is shorter than `out`.
pub fn bf16s_f32_row(isa: CpuIsa, v: &[half::bf16], out: &mut [f32]) {
    let v = &v[..out.len()];
    if cfg!(target_endian = "little") {
        // In memory, a bf16 is its bits' little-endian bytes here.
        bf16_f32_row(isa, bytemuck::cast_slice(v), out);
    } else {
        for (x, b) in out.iter_mut().zip(v) {
            *x = bf16_daz(b.to_bits());
        }
    }
}

/// One fp4 group: the 32 values of `packed` (its first 16 bytes, the even element in the
/// low nibble) times the scale of ue8m0 byte `sb`, as bf16 bits ([`fp4_bf16`]) into the
/// first 32 words of `out`, on the vector path `isa`. Panics if `packed` is shorter than 16
/// bytes or `out` than 32 words.
pub fn fp4_group(isa: CpuIsa, packed: &[u8], sb: u8, out: &mut [u16]) {
    fp4_groups(isa, &packed[..16], &[sb], &mut out[..32]);
}

/// [`fp4_group`] for `scales.len()` groups in a row: group `g` is `packed[16g..16g + 16]`
/// at scale byte `scales[g]`, into `out[32g..32g + 32]` (a segment of index keys in one
/// call: the table is loaded once). Panics if `packed` is shorter than 16 bytes a group or
/// `out` than 32 words a group.
pub fn fp4_groups(isa: CpuIsa, packed: &[u8], scales: &[u8], out: &mut [u16]) {
    let groups = scales.len();
    let (packed, out) = (&packed[..16 * groups], &mut out[..32 * groups]);
    #[cfg(target_arch = "x86_64")]
    if isa.isa().avx512() {
        // SAFETY: the AVX-512 paths' CPU has AVX-512F and AVX-512BW; 16 bytes and 32
        // words per scale byte (sliced above).
        unsafe { x86::fp4_groups(packed, scales, out) };
        return;
    }
    let _ = isa;
    each_group(packed, scales, out, fp4_group_values);
}

/// fp4 groups as f32, for the FMA kernels: group `g` is `packed[16g..16g + 16]` (the even
/// element in the low nibble) at scale byte `scales[g]`, and `out[32g + i]` gets its
/// element `i` as `f32_daz(e2m1 · ue8m0 scale)` (exact but for that flush; a NaN scale
/// byte gives NaN). On the AVX paths 8 values at a time (an 8-entry `vpermps` table,
/// the sign or-ed in, one multiply) for scale bytes 2..=254, whose products are never
/// subnormal; the others value by value. Panics if `packed` is shorter than 16 bytes a
/// group or `out` than 32 values a group.
pub fn fp4_f32_groups(isa: CpuIsa, packed: &[u8], scales: &[u8], out: &mut [f32]) {
    let groups = scales.len();
    let (packed, out) = (&packed[..16 * groups], &mut out[..32 * groups]);
    #[cfg(target_arch = "x86_64")]
    if isa.isa() != Isa::Scalar {
        // SAFETY: every vector path's CPU has AVX2 (`Isa::supported`); 16 bytes and 32
        // values per scale byte (sliced above).
        unsafe { x86::fp4_f32_groups256(packed, scales, out) };
        return;
    }
    let _ = isa;
    each_group(packed, scales, out, fp4_f32_group_values);
}

/// `group(packed, scale byte, out)` for each fp4 group of a row: 16 bytes of `packed` and
/// 32 values of `out` per scale byte.
#[inline(always)]
fn each_group<T>(packed: &[u8], scales: &[u8], out: &mut [T], group: impl Fn(&[u8], u8, &mut [T])) {
    for ((o, p), &sb) in out
        .chunks_exact_mut(32)
        .zip(packed.chunks_exact(16))
        .zip(scales)
    {
        group(p, sb, o);
    }
}

/// One group of [`fp4_f32_groups`] value by value.
#[inline(always)]
fn fp4_f32_group_values(packed: &[u8], sb: u8, out: &mut [f32]) {
    let s = ue8m0_to_f32(sb);
    for (x2, &b) in out.chunks_exact_mut(2).zip(packed) {
        x2[0] = f32_daz(e2m1_to_f32(b & 0xf) * s);
        x2[1] = f32_daz(e2m1_to_f32(b >> 4) * s);
    }
}

/// [`fp4_group`] value by value ([`fp4_bf16`]).
#[inline(always)]
fn fp4_group_values(packed: &[u8], sb: u8, out: &mut [u16]) {
    for (pair, &b) in out.chunks_exact_mut(2).zip(packed) {
        pair[0] = fp4_bf16(b & 0xf, sb);
        pair[1] = fp4_bf16(b >> 4, sb);
    }
}

/// bf16 bits of the e4m3 magnitudes `0..128` (the sign is the code's top bit).
const E4M3_MAGNITUDES: [u16; 128] = {
    let mut t = [0u16; 128];
    let mut c = 0;
    while c < 128 {
        t[c] = (decode_bits(c as u8).to_bits() >> 16) as u16;
        c += 1;
    }
    t
};

/// The high (`[0]`) and low (`[1]`) bytes of [`E4M3_MAGNITUDES`]: the two 128-entry byte
/// tables of the VBMI lookups (`vpermi2b` reads a code's low 7 bits).
const E4M3_MAGNITUDE_BYTES: [[u8; 128]; 2] = {
    let mut t = [[0u8; 128]; 2];
    let mut c = 0;
    while c < 128 {
        t[0][c] = (E4M3_MAGNITUDES[c] >> 8) as u8;
        t[1][c] = E4M3_MAGNITUDES[c] as u8;
        c += 1;
    }
    t
};

/// `vpermb` indices of the VBMI lookups, placing 64 codes so that the byte then word
/// unpacks (which interleave within 128-bit lanes) leave the results in code order:
/// `[0]` for words (position `16L + i` takes code `8L + i`, `16L + 8 + i` code
/// `32 + 8L + i`), `[1]` for dwords (position `16L + 4r + d` takes code `16r + 4L + d`).
const VBMI_ORDER: [[u8; 64]; 2] = {
    let mut t = [[0u8; 64]; 2];
    let mut l = 0;
    while l < 4 {
        let mut i = 0;
        while i < 8 {
            t[0][16 * l + i] = (8 * l + i) as u8;
            t[0][16 * l + 8 + i] = (32 + 8 * l + i) as u8;
            i += 1;
        }
        let mut r = 0;
        while r < 4 {
            let mut d = 0;
            while d < 4 {
                t[1][16 * l + 4 * r + d] = (16 * r + 4 * l + d) as u8;
                d += 1;
            }
            r += 1;
        }
        l += 1;
    }
    t
};

/// `vpermw` indices placing words `0..16` (`[0]`) or `16..32` (`[1]`) of a register in the
/// odd words, i.e. the high halves of dwords `0..16` (the even words are masked to zero).
const BF16_HIGH_WORDS: [[u16; 32]; 2] = {
    let mut t = [[0u16; 32]; 2];
    let mut j = 0;
    while j < 32 {
        t[0][j] = (j / 2) as u16;
        t[1][j] = 16 + (j / 2) as u16;
        j += 1;
    }
    t
};

/// bf16 bits of the e2m1 codes `0..16` (sign included: code 8 is −0).
const E2M1_VALUES: [u16; 16] = [
    0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0, 0x8000, 0xbf00, 0xbf80, 0xbfc0,
    0xc000, 0xc040, 0xc080, 0xc0c0,
];

#[cfg(target_arch = "x86_64")]
#[allow(
    clippy::incompatible_msrv,
    reason = "AVX-512 needs Rust 1.89, as the existing AVX-512 target features do"
)]
pub(super) mod x86 {
    use std::arch::x86_64::*;

    use crate::cpu::raw;

    use super::{
        e2m1_to_f32, e4m3_f32, f32_daz, BF16_HIGH_WORDS, E2M1_VALUES, E4M3_MAGNITUDES,
        E4M3_MAGNITUDE_BYTES, VBMI_ORDER,
    };

    /// Whether the CPU has AVX-512 VBMI (byte permutes), for the e4m3 byte-table lookups
    /// (std caches the answer: one atomic load).
    #[inline(always)]
    pub(in crate::cpu) fn has_vbmi() -> bool {
        std::is_x86_feature_detected!("avx512vbmi")
    }

    /// e4m3 codes to the high (`.0`) and low (`.1`) bytes of their bf16 bits, 64 codes
    /// `c` (already placed by a [`VBMI_ORDER`] permute) at a time: two 128-entry byte-table
    /// lookups (`vpermi2b`, on the low 7 bits), the sign or-ed into the high byte.
    ///
    /// # Safety
    /// The CPU has AVX-512F, AVX-512BW and AVX-512 VBMI.
    #[inline(always)]
    unsafe fn e4m3_bf16_bytes(c: __m512i, tables: &[__m512i; 4]) -> (__m512i, __m512i) {
        // SAFETY: register operations only; the features are the caller's.
        unsafe {
            let hi = _mm512_permutex2var_epi8(tables[0], c, tables[1]);
            let lo = _mm512_permutex2var_epi8(tables[2], c, tables[3]);
            // hi | (c & 0x80): the table's high bytes have bit 7 clear.
            let hi = _mm512_ternarylogic_epi32::<0xf8>(hi, c, _mm512_set1_epi8(i8::MIN));
            (hi, lo)
        }
    }

    /// The byte tables of [`e4m3_bf16_bytes`] in registers.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[inline(always)]
    unsafe fn e4m3_byte_tables() -> [__m512i; 4] {
        let [hi, lo] = &E4M3_MAGNITUDE_BYTES;
        // SAFETY: each table is 128 bytes: two 64-byte loads each.
        unsafe {
            [
                raw::read::<__m512i>(hi.as_ptr().cast()),
                raw::read::<__m512i>(hi.as_ptr().add(64).cast()),
                raw::read::<__m512i>(lo.as_ptr().cast()),
                raw::read::<__m512i>(lo.as_ptr().add(64).cast()),
            ]
        }
    }

    /// The e4m3 → bf16 byte-table lookup with its tables in registers, for kernels that
    /// widen codes 64 at a time between instructions of their own (the e4m3 keys of
    /// [`crate::cpu::dot::gemm_e4m3_into`]).
    #[derive(Clone, Copy)]
    pub(in crate::cpu) struct E4m3Words {
        tables: [__m512i; 4],
        order: __m512i,
    }

    impl E4m3Words {
        /// The tables and the code order of the word unpacks.
        ///
        /// # Safety
        /// The CPU has AVX-512F.
        #[inline(always)]
        pub(in crate::cpu) unsafe fn load() -> Self {
            // SAFETY: the tables' own loads (the feature is the caller's); `VBMI_ORDER[0]`
            // is 64 bytes.
            unsafe {
                E4m3Words {
                    tables: e4m3_byte_tables(),
                    order: raw::read::<__m512i>(VBMI_ORDER[0].as_ptr().cast()),
                }
            }
        }

        /// The bf16 bits of the 64 codes `c`, in code order: codes `0..32` in the first
        /// vector, `32..64` in the second (exact: every e4m3 value is a bf16 value).
        ///
        /// # Safety
        /// The CPU has AVX-512F, AVX-512BW and AVX-512 VBMI.
        #[inline(always)]
        pub(in crate::cpu) unsafe fn words(&self, c: __m512i) -> (__m512i, __m512i) {
            // SAFETY: register operations only; the features are the caller's.
            unsafe {
                let (hi, lo) =
                    e4m3_bf16_bytes(_mm512_permutexvar_epi8(self.order, c), &self.tables);
                (_mm512_unpacklo_epi8(lo, hi), _mm512_unpackhi_epi8(lo, hi))
            }
        }

        /// [`Self::words`] of the 64 codes at `codes`, written to the 64 words at `out`.
        ///
        /// # Safety
        /// As [`Self::words`]; 64 bytes are readable at `codes` and 64 words writable at
        /// `out` (no alignment needed).
        #[inline(always)]
        pub(in crate::cpu) unsafe fn widen64(&self, codes: *const u8, out: *mut u16) {
            // SAFETY: the caller's contract.
            unsafe {
                let (w0, w1) = self.words(raw::read::<__m512i>(codes.cast()));
                raw::write::<__m512i>(out.cast(), w0);
                raw::write::<__m512i>(out.add(32).cast(), w1);
            }
        }
    }

    /// [`super::e4m3_tiles_pow2`] by byte tables: 64 codes at a time (about 40% faster
    /// than the word tables at `k = 0`), the bf16 bits of each code's value, then `k` added
    /// to the exponent field of the nonzero finite ones (a magnitude of neither 0 nor
    /// `0x7f`); products stay normal for `k` in -117..=119.
    ///
    /// # Safety
    /// The CPU has AVX-512F, AVX-512BW and AVX-512 VBMI; `codes` and `out` hold `tile ·
    /// ks.len()` values, `tile` a multiple of 64, every `k` in -117..=119.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    pub(super) unsafe fn e4m3_bf16_tiles_vbmi(
        codes: &[u8],
        tile: usize,
        ks: &[i32],
        out: &mut [u16],
    ) {
        debug_assert!(tile % 64 == 0 && codes.len() == tile * ks.len() && out.len() == codes.len());
        // SAFETY: 64 bytes read from `codes` and 64 words written to `out` at `i`, with
        // `i + 64 ≤ (t + 1)·tile ≤` both lengths; the features are this function's own.
        unsafe {
            let lookup = E4m3Words::load();
            let magnitude = _mm512_set1_epi8(0x7f);
            for (t, &k) in ks.iter().enumerate() {
                let shift = _mm512_set1_epi16((k << 7) as i16);
                let mut i = t * tile;
                while i < (t + 1) * tile {
                    let c = raw::read::<__m512i>(codes.as_ptr().add(i).cast());
                    let (mut w0, mut w1) = lookup.words(c);
                    if k != 0 {
                        // Code `j`'s bit (in code order, as the words are): finite nonzero.
                        let m = _mm512_and_si512(c, magnitude);
                        let scaled =
                            _mm512_test_epi8_mask(m, m) & _mm512_cmpneq_epi8_mask(m, magnitude);
                        w0 = _mm512_mask_add_epi16(w0, scaled as __mmask32, w0, shift);
                        w1 = _mm512_mask_add_epi16(w1, (scaled >> 32) as __mmask32, w1, shift);
                    }
                    let o = out.as_mut_ptr().add(i);
                    raw::write::<__m512i>(o.cast(), w0);
                    raw::write::<__m512i>(o.add(32).cast(), w1);
                    i += 64;
                }
            }
        }
    }

    /// [`super::e4m3_f32_row`] by byte tables: the bf16 bits of each code (exact: every
    /// e4m3 value is a bf16 value) moved to the high half of a zeroed dword, 64 codes at a
    /// time (about 30% faster than the f16 route); returns how many it widened (a multiple
    /// of 64, the rest are the caller's).
    ///
    /// # Safety
    /// The CPU has AVX-512F, AVX-512BW and AVX-512 VBMI; `codes` and `out` have the same
    /// length.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    pub(super) unsafe fn e4m3_f32_row_vbmi(codes: &[u8], out: &mut [f32]) -> usize {
        debug_assert_eq!(codes.len(), out.len());
        let n = codes.len() / 64 * 64;
        // SAFETY: 64 bytes read from `codes` and 64 f32 written to `out` at `i`, with
        // `i + 64 ≤ n`; the features are this function's own.
        unsafe {
            let tables = e4m3_byte_tables();
            let order = raw::read::<__m512i>(VBMI_ORDER[1].as_ptr().cast());
            let zero = _mm512_setzero_si512();
            let mut i = 0;
            while i < n {
                let c = raw::read::<__m512i>(codes.as_ptr().add(i).cast());
                let (hi, lo) = e4m3_bf16_bytes(_mm512_permutexvar_epi8(order, c), &tables);
                let (w0, w1) = (_mm512_unpacklo_epi8(lo, hi), _mm512_unpackhi_epi8(lo, hi));
                let o = out.as_mut_ptr().add(i);
                raw::write::<__m512i>(o.cast(), _mm512_unpacklo_epi16(zero, w0));
                raw::write::<__m512i>(o.add(16).cast(), _mm512_unpackhi_epi16(zero, w0));
                raw::write::<__m512i>(o.add(32).cast(), _mm512_unpacklo_epi16(zero, w1));
                raw::write::<__m512i>(o.add(48).cast(), _mm512_unpackhi_epi16(zero, w1));
                i += 64;
            }
        }
        n
    }

    /// [`super::e4m3_row_pow2`] for `k` in `-117..=119`: 32 codes at a time, the
    /// magnitude from two 64-entry word tables (`vpermi2w` on the low 6 bits, bit 6 picks
    /// the table), `k` added to the exponent of the finite nonzero ones (no add at all
    /// for `k = 0`, the fp8 index keys), the sign or-ed in from the sign-extended code.
    ///
    /// # Safety
    /// The CPU has AVX-512F and AVX-512BW; `codes` and `out` have the same length.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn e4m3_row(codes: &[u8], k: i32, out: &mut [u16]) {
        debug_assert_eq!(codes.len(), out.len());
        debug_assert!((-117..=119).contains(&k));
        // SAFETY: the CPU features are this function's own (`e4m3_rows` is inlined into
        // it); the lengths are equal (asserted by the caller's contract).
        unsafe {
            if k == 0 {
                e4m3_rows::<false>(codes, 0, out)
            } else {
                e4m3_rows::<true>(codes, k, out)
            }
        }
        let n = codes.len() / 32 * 32;
        if n < codes.len() {
            let s = 2f32.powi(k);
            for (x, &c) in out[n..].iter_mut().zip(&codes[n..]) {
                *x = (f32_daz(e4m3_f32(c) * s).to_bits() >> 16) as u16;
            }
        }
    }

    /// The whole vectors of [`e4m3_row`]; `SCALED = false` only for `k = 0`.
    ///
    /// # Safety
    /// As [`e4m3_row`]'s.
    #[inline(always)]
    unsafe fn e4m3_rows<const SCALED: bool>(codes: &[u8], k: i32, out: &mut [u16]) {
        // SAFETY: the tables are 128 words; every load and store below is inside `codes`
        // (32 bytes from `i`, `i + 32 ≤ n`) and `out` (32 words from `i`); the CPU
        // features are the caller's.
        unsafe {
            let t = E4M3_MAGNITUDES.as_ptr();
            let tab = |k: usize| raw::read::<__m512i>(t.add(32 * k).cast());
            let (t0, t1, t2, t3) = (tab(0), tab(1), tab(2), tab(3));
            let (bit6, sign) = (_mm512_set1_epi16(0x40), _mm512_set1_epi16(i16::MIN));
            // Magnitude 0x7f is NaN: like 0, it keeps its table value.
            let magnitude = _mm512_set1_epi16(0x7f);
            let shift = _mm512_set1_epi16((k << 7) as i16);
            let n = codes.len() / 32 * 32;
            let mut i = 0;
            while i < n {
                // Sign-extended: bit 15 is the code's sign, bits 0..7 the code (the
                // table lookups read the low 6 bits only).
                let c = _mm512_cvtepi8_epi16(raw::read::<__m256i>(codes.as_ptr().add(i).cast()));
                let low = _mm512_permutex2var_epi16(t0, c, t1);
                let high = _mm512_permutex2var_epi16(t2, c, t3);
                let mut v = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(c, bit6), low, high);
                if SCALED {
                    let m = _mm512_and_si512(c, magnitude);
                    let scaled =
                        _mm512_test_epi16_mask(m, m) & _mm512_cmpneq_epi16_mask(m, magnitude);
                    v = _mm512_mask_add_epi16(v, scaled, v, shift);
                }
                // v | (c & sign): the table's magnitudes have bit 15 clear.
                let v = _mm512_ternarylogic_epi32::<0xf8>(v, c, sign);
                raw::write::<__m512i>(out.as_mut_ptr().add(i).cast(), v);
                i += 32;
            }
        }
    }

    /// [`super::e4m3_f32_row`] on whole vectors of 32 codes; returns how many codes it
    /// widened (the rest are the caller's).
    ///
    /// # Safety
    /// The CPU has AVX-512F, AVX-512BW and F16C; `codes` and `out` have the same length.
    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    pub(super) unsafe fn e4m3_f32_row512(codes: &[u8], out: &mut [f32]) -> usize {
        debug_assert_eq!(codes.len(), out.len());
        let n = codes.len() / 32 * 32;
        // SAFETY: 32 bytes read from `codes` and 32 f32 written to `out` at `i`, with
        // `i + 32 ≤ n`.
        unsafe {
            let two8 = _mm512_set1_ps(256.0);
            let (clear14, low7) = (_mm512_set1_epi16(0xbfffu16 as i16), _mm512_set1_epi16(0x7f));
            let fix = _mm512_set1_epi16(0x3f80 ^ 0x7e00);
            let mut i = 0;
            while i < n {
                // Sign-extended: a negative code's high byte is all ones.
                let c = _mm512_cvtepi8_epi16(raw::read::<__m256i>(codes.as_ptr().add(i).cast()));
                // f16 bits of the codes times 2^-8: the 7 low bits to bits 7..13 and the
                // sign to bits 14 and 15 (`c << 7` of the sign-extended code), then bit 14
                // cleared; magnitude `0x7f` (NaN) becomes the quiet NaN `0x7e00` with its
                // sign (what `e4m3_f32`'s NaN narrows from).
                let h = _mm512_and_si512(_mm512_slli_epi16::<7>(c), clear14);
                let nan = _mm512_cmpeq_epi16_mask(_mm512_and_si512(c, low7), low7);
                let h = _mm512_mask_mov_epi16(h, nan, _mm512_xor_si512(h, fix));
                let lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
                let hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(h));
                let o = out.as_mut_ptr().add(i);
                raw::write::<__m512>(o.cast(), _mm512_mul_ps(lo, two8));
                raw::write::<__m512>(o.add(16).cast(), _mm512_mul_ps(hi, two8));
                i += 32;
            }
        }
        n
    }

    /// [`super::e4m3_f16_row`] on whole vectors of 64 codes: returns how many it widened
    /// (the rest are the caller's) and whether one of them is NaN.
    ///
    /// # Safety
    /// The CPU has AVX-512F and AVX-512BW; `codes` and `out` have the same length.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn e4m3_f16_row512(codes: &[u8], out: &mut [u16]) -> (usize, bool) {
        debug_assert_eq!(codes.len(), out.len());
        let n = codes.len() / 64 * 64;
        // SAFETY: 64 bytes read from `codes` and 64 u16 written to `out` at `i`, with
        // `i + 64 ≤ n`.
        unsafe {
            let clear14 = _mm512_set1_epi16(0xbfffu16 as i16);
            let (sign, ones) = (_mm512_set1_epi8(0x80u8 as i8), _mm512_set1_epi8(-1));
            let mut nan: __mmask64 = 0;
            let mut i = 0;
            while i < n {
                let p = codes.as_ptr().add(i);
                // NaN codes: `c | 0x80 == 0xff`.
                let c = raw::read::<__m512i>(p.cast());
                nan |= _mm512_cmpeq_epi8_mask(_mm512_or_si512(c, sign), ones);
                for half in 0..2 {
                    let w = _mm512_cvtepi8_epi16(raw::read::<__m256i>(p.add(32 * half).cast()));
                    let h = _mm512_and_si512(_mm512_slli_epi16::<7>(w), clear14);
                    raw::write::<__m512i>(out.as_mut_ptr().add(i + 32 * half).cast(), h);
                }
                i += 64;
            }
            (n, nan != 0)
        }
    }

    /// [`super::e4m3_f16_row`] on whole vectors of 32 codes: returns how many it widened
    /// (the rest are the caller's) and whether one of them is NaN.
    ///
    /// # Safety
    /// The CPU has AVX2; `codes` and `out` have the same length.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn e4m3_f16_row256(codes: &[u8], out: &mut [u16]) -> (usize, bool) {
        debug_assert_eq!(codes.len(), out.len());
        let n = codes.len() / 32 * 32;
        // SAFETY: 32 bytes read from `codes` and 32 u16 written to `out` at `i`, with
        // `i + 32 ≤ n`.
        unsafe {
            let clear14 = _mm256_set1_epi16(0xbfffu16 as i16);
            let sign = _mm256_set1_epi8(0x80u8 as i8);
            let mut nan = _mm256_setzero_si256();
            let mut i = 0;
            while i < n {
                let p = codes.as_ptr().add(i);
                // NaN codes: `c | 0x80 == 0xff`.
                let c = raw::read::<__m256i>(p.cast());
                let ones = _mm256_cmpeq_epi8(c, c);
                nan = _mm256_or_si256(nan, _mm256_cmpeq_epi8(_mm256_or_si256(c, sign), ones));
                for half in 0..2 {
                    let w = _mm256_cvtepi8_epi16(raw::read::<__m128i>(p.add(16 * half).cast()));
                    let h = _mm256_and_si256(_mm256_slli_epi16::<7>(w), clear14);
                    raw::write::<__m256i>(out.as_mut_ptr().add(i + 16 * half).cast(), h);
                }
                i += 32;
            }
            (n, _mm256_testz_si256(nan, nan) == 0)
        }
    }

    /// [`e4m3_f32_row512`] with AVX2 and F16C, 16 codes at a time.
    ///
    /// # Safety
    /// The CPU has AVX2 and F16C; `codes` and `out` have the same length.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn e4m3_f32_row256(codes: &[u8], out: &mut [f32]) -> usize {
        debug_assert_eq!(codes.len(), out.len());
        let n = codes.len() / 16 * 16;
        // SAFETY: 16 bytes read from `codes` and 16 f32 written to `out` at `i`, with
        // `i + 16 ≤ n`.
        unsafe {
            let two8 = _mm256_set1_ps(256.0);
            let (clear14, low7) = (_mm256_set1_epi16(0xbfffu16 as i16), _mm256_set1_epi16(0x7f));
            let fix = _mm256_set1_epi16(0x3f80 ^ 0x7e00);
            let mut i = 0;
            while i < n {
                let c = _mm256_cvtepi8_epi16(raw::read::<__m128i>(codes.as_ptr().add(i).cast()));
                // As in `e4m3_f32_row512`.
                let h = _mm256_and_si256(_mm256_slli_epi16::<7>(c), clear14);
                let nan = _mm256_cmpeq_epi16(_mm256_and_si256(c, low7), low7);
                let h = _mm256_xor_si256(h, _mm256_and_si256(nan, fix));
                let lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
                let hi = _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(h));
                let o = out.as_mut_ptr().add(i);
                raw::write::<__m256>(o.cast(), _mm256_mul_ps(lo, two8));
                raw::write::<__m256>(o.add(8).cast(), _mm256_mul_ps(hi, two8));
                i += 16;
            }
        }
        n
    }

    /// [`super::bf16_f32_row`] on whole vectors of 32 values; returns how many it widened
    /// (the rest are the caller's). Per 32: the exponent-zero words lose all but their
    /// sign (`vptestnmw`, then a masked subtract of their magnitude), and two zero-masked
    /// `vpermw` put words `0..16` and `16..32` in the high halves of zeroed dwords.
    ///
    /// # Safety
    /// The CPU has AVX-512F and AVX-512BW; `bytes` holds `2 · out.len()` bytes.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn bf16_f32_row512(bytes: &[u8], out: &mut [f32]) -> usize {
        debug_assert_eq!(bytes.len(), 2 * out.len());
        let n = out.len() / 32 * 32;
        // SAFETY: 64 bytes read from `bytes` at `2i` and 32 f32 written to `out` at `i`,
        // with `i + 32 ≤ n`.
        unsafe {
            let (exponent, magnitude) = (_mm512_set1_epi16(0x7f80), _mm512_set1_epi16(0x7fff));
            let lo_idx = raw::read::<__m512i>(BF16_HIGH_WORDS[0].as_ptr().cast());
            let hi_idx = raw::read::<__m512i>(BF16_HIGH_WORDS[1].as_ptr().cast());
            const HIGH_WORDS: __mmask32 = 0xaaaa_aaaa;
            let mut i = 0;
            while i < n {
                let x = raw::read::<__m512i>(bytes.as_ptr().add(2 * i).cast());
                let sub = _mm512_testn_epi16_mask(x, exponent);
                let x = _mm512_mask_sub_epi16(x, sub, x, _mm512_and_si512(x, magnitude));
                let o = out.as_mut_ptr().add(i);
                raw::write::<__m512i>(
                    o.cast(),
                    _mm512_maskz_permutexvar_epi16(HIGH_WORDS, lo_idx, x),
                );
                raw::write::<__m512i>(
                    o.add(16).cast(),
                    _mm512_maskz_permutexvar_epi16(HIGH_WORDS, hi_idx, x),
                );
                i += 32;
            }
        }
        n
    }

    /// [`super::bf16_f32_row`] with AVX2, 16 values at a time: the flush as in
    /// [`bf16_f32_row512`] (a compare and two masks), qwords reordered so that each
    /// lane's word unpacks with zero give words `0..8` and `8..16` in order.
    ///
    /// # Safety
    /// The CPU has AVX2; `bytes` holds `2 · out.len()` bytes.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn bf16_f32_row256(bytes: &[u8], out: &mut [f32]) -> usize {
        debug_assert_eq!(bytes.len(), 2 * out.len());
        let n = out.len() / 16 * 16;
        // SAFETY: 32 bytes read from `bytes` at `2i` and 16 f32 written to `out` at `i`,
        // with `i + 16 ≤ n`.
        unsafe {
            let (exponent, magnitude) = (_mm256_set1_epi16(0x7f80), _mm256_set1_epi16(0x7fff));
            let zero = _mm256_setzero_si256();
            let mut i = 0;
            while i < n {
                let x = raw::read::<__m256i>(bytes.as_ptr().add(2 * i).cast());
                let sub = _mm256_cmpeq_epi16(_mm256_and_si256(x, exponent), zero);
                let x = _mm256_andnot_si256(_mm256_and_si256(sub, magnitude), x);
                // Qwords 0, 2 | 1, 3: lane 0 holds words 0..4 and 8..12, lane 1 4..8, 12..16.
                let x = _mm256_permute4x64_epi64::<0b11_01_10_00>(x);
                let o = out.as_mut_ptr().add(i);
                raw::write::<__m256i>(o.cast(), _mm256_unpacklo_epi16(zero, x));
                raw::write::<__m256i>(o.add(8).cast(), _mm256_unpackhi_epi16(zero, x));
                i += 16;
            }
        }
        n
    }

    /// [`super::fp4_f32_groups`] on AVX2: per group with `sb` in `2..=254` (every nonzero
    /// product at least 0.5 · 2^-125: normal; the multiply rounds as the scalar one), the
    /// 32 codes in element order as bytes (nibbles split, then interleaved), 8 at a time
    /// widened to dwords, their magnitudes looked up (`vpermps` reads the low 3 bits), the
    /// sign (bit 3) moved to bit 31, times the scale; other scale bytes value by value.
    ///
    /// # Safety
    /// The CPU has AVX2; `packed` holds 16 bytes and `out` 32 values per scale byte.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn fp4_f32_groups256(packed: &[u8], scales: &[u8], out: &mut [f32]) {
        debug_assert!(packed.len() >= 16 * scales.len() && out.len() >= 32 * scales.len());
        let magnitudes: [f32; 8] = std::array::from_fn(|i| e2m1_to_f32(i as u8));
        // SAFETY: per group `g`, 16 bytes read from `packed` at `16g` and 32 values
        // written to `out` at `32g` (the caller's lengths); the table is 8 values.
        unsafe {
            let table = raw::read::<__m256>(magnitudes.as_ptr().cast());
            let (nibble, sign) = (_mm_set1_epi8(0x0f), _mm256_set1_epi32(8));
            for (g, &sb) in scales.iter().enumerate() {
                if !(2..=254).contains(&sb) {
                    let (p, o) = (&packed[16 * g..][..16], &mut out[32 * g..][..32]);
                    super::fp4_f32_group_values(p, sb, o);
                    continue;
                }
                let s = _mm256_set1_ps(f32::from_bits((sb as u32) << 23));
                let b = raw::read::<__m128i>(packed.as_ptr().add(16 * g).cast());
                let lo = _mm_and_si128(b, nibble);
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(b), nibble);
                let codes = [_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)];
                let o = out.as_mut_ptr().add(32 * g);
                for (h, &c) in codes.iter().enumerate() {
                    for (q, c8) in [c, _mm_srli_si128::<8>(c)].into_iter().enumerate() {
                        let d = _mm256_cvtepu8_epi32(c8);
                        let mag = _mm256_permutevar8x32_ps(table, d);
                        let sg = _mm256_slli_epi32::<28>(_mm256_and_si256(d, sign));
                        let v = _mm256_or_ps(mag, _mm256_castsi256_ps(sg));
                        raw::write::<__m256>(o.add(16 * h + 8 * q).cast(), _mm256_mul_ps(v, s));
                    }
                }
            }
        }
    }

    /// [`super::fp4_groups`]: per group with `sb` in `2..=252` (products of a nonzero
    /// e2m1, 0.5 ..= 6, and `2^(sb − 127)` stay normal bf16 values), the 16 bytes widened
    /// to dwords (low nibble in the low word, high nibble in the high word: element order),
    /// each word's code looked up (`vpermw`), and `k = sb − 127` added to the exponent of
    /// the nonzero ones (exact); other scales (and NaN, `0xff`) value by value.
    ///
    /// # Safety
    /// The CPU has AVX-512F and AVX-512BW; `packed` holds 16 bytes and `out` 32 words per
    /// scale byte.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn fp4_groups(packed: &[u8], scales: &[u8], out: &mut [u16]) {
        debug_assert!(packed.len() >= 16 * scales.len() && out.len() >= 32 * scales.len());
        // SAFETY: per group `g`, 16 bytes read from `packed` and 32 words written to `out`
        // at `16g` and `32g` (the caller's lengths); 16 words of the table (the upper half
        // of the vector is never indexed: codes are below 16).
        unsafe {
            let mut table = [0u16; 32];
            table[..16].copy_from_slice(&E2M1_VALUES);
            let t = raw::read::<__m512i>(table.as_ptr().cast());
            let (low, high) = (_mm512_set1_epi32(0xf), _mm512_set1_epi32(0xf0));
            let magnitude = _mm512_set1_epi16(7);
            for (g, &sb) in scales.iter().enumerate() {
                if !(2..=252).contains(&sb) {
                    let (p, o) = (&packed[16 * g..][..16], &mut out[32 * g..][..32]);
                    super::fp4_group_values(p, sb, o);
                    continue;
                }
                let o = out.as_mut_ptr().add(32 * g);
                let b =
                    _mm512_cvtepu8_epi32(raw::read::<__m128i>(packed.as_ptr().add(16 * g).cast()));
                let codes = _mm512_or_si512(
                    _mm512_and_si512(b, low),
                    _mm512_slli_epi32::<12>(_mm512_and_si512(b, high)),
                );
                let v = _mm512_permutexvar_epi16(codes, t);
                let nonzero = _mm512_test_epi16_mask(codes, magnitude);
                let k = ((sb as i32 - 127) << 7) as i16;
                let v = _mm512_mask_add_epi16(v, nonzero, v, _mm512_set1_epi16(k));
                raw::write::<__m512i>(o.cast(), v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// bf16 bits of the e4m3 code `c`'s value: the top half of [`e4m3_f32`] (NaN
    /// `0x7fc0`).
    fn e4m3_bf16(c: u8) -> u16 {
        (e4m3_f32(c).to_bits() >> 16) as u16
    }

    /// Every path gives every e4m3 code's f16 form (`2^-8` times its value, exactly) and
    /// flags a NaN code wherever it sits (vector part or tail), and only then.
    #[test]
    fn e4m3_f16_rows_are_exact_and_flag_nan_anywhere() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        let is_nan = |c: u8| c & 0x7f == 0x7f;
        for len in (0..70).chain([256, 1000]) {
            let mut codes: Vec<u8> = (0..len)
                .map(|i| if i < 256 { i as u8 } else { rng.gen() })
                .collect();
            codes.reverse();
            // Without NaN codes, then with one at a random place.
            for c in codes.iter_mut().filter(|c| is_nan(**c)) {
                *c ^= 1;
            }
            for with_nan in [false, true] {
                if with_nan && len > 0 {
                    codes[rng.gen_range(0..len)] = [0x7f, 0xff][rng.gen_range(0..2)];
                }
                for isa in CpuIsa::available() {
                    let mut out = vec![0x7e00u16; len];
                    let nan = e4m3_f16_row(isa, &codes, &mut out);
                    assert_eq!(nan, with_nan && len > 0, "{} len {len}", isa.isa());
                    for (&c, &x) in codes.iter().zip(&out).filter(|(c, _)| !is_nan(**c)) {
                        let v = half::f16::from_bits(x).to_f32() * 256.0;
                        assert_eq!(v.to_bits(), e4m3_f32(c).to_bits(), "{} {c:#04x}", isa.isa());
                    }
                }
            }
        }
    }

    /// Every path widens every e4m3 code to [`e4m3_bf16`]'s bits, over rows of every
    /// length around the vector width, codes in random order.
    #[test]
    fn e4m3_rows_are_identical_on_every_path() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for len in (0..70).chain([128, 256, 448, 512, 1000]) {
            let codes: Vec<u8> = (0..len)
                .map(|i| if i < 256 { i as u8 } else { rng.gen() })
                .collect();
            let mut codes = codes;
            codes.reverse();
            for isa in CpuIsa::available() {
                let mut out = vec![0xaaaau16; len];
                e4m3_row_pow2(isa, &codes, 0, &mut out);
                for (&c, &x) in codes.iter().zip(&out) {
                    assert_eq!(x, e4m3_bf16(c), "{} code {c:#04x}", isa.isa());
                }
            }
        }
        // Every code once, in one row.
        let codes: Vec<u8> = (0..=255).collect();
        for isa in CpuIsa::available() {
            let mut out = vec![0u16; 256];
            e4m3_row_pow2(isa, &codes, 0, &mut out);
            for (&c, &x) in codes.iter().zip(&out) {
                assert_eq!(x, e4m3_bf16(c), "{} code {c:#04x}", isa.isa());
            }
        }
    }

    /// Both AVX-512 routes of the e4m3 widenings — the VBMI byte tables where the CPU has
    /// them, and the word tables / f16 route it takes without (which a VBMI machine's path
    /// only uses for a row's last codes) — give every code's bits, over whole rows.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn e4m3_rows_are_identical_with_and_without_vbmi() {
        if !CpuIsa::available().iter().any(|i| i.isa() == Isa::Avx512) {
            return;
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        let mut codes: Vec<u8> = (0..=255).chain((0..768).map(|_| rng.gen())).collect();
        for i in (1..codes.len()).rev() {
            codes.swap(i, rng.gen_range(0..=i));
        }
        let n = codes.len();
        let check_f32 = |out: &[f32], route: &str| {
            for (&c, &x) in codes.iter().zip(out) {
                assert_eq!(x.to_bits(), e4m3_f32(c).to_bits(), "{route} code {c:#04x}");
            }
        };
        let mut out = vec![f32::from_bits(0x7fa5_a5a5); n];
        // SAFETY: the avx512 path is available: AVX-512F/BW and F16C; equal lengths.
        let done = unsafe { x86::e4m3_f32_row512(&codes, &mut out) };
        assert_eq!(done, n);
        check_f32(&out, "f16 route");
        let mut words = vec![0xaaaau16; n];
        // SAFETY: as above.
        unsafe { x86::e4m3_row(&codes, 0, &mut words) };
        for (&c, &x) in codes.iter().zip(&words) {
            assert_eq!(x, e4m3_bf16(c), "word tables code {c:#04x}");
        }
        if x86::has_vbmi() {
            let mut out = vec![f32::from_bits(0x7fa5_a5a5); n];
            // SAFETY: AVX-512F/BW as above and VBMI (checked); equal lengths.
            let done = unsafe { x86::e4m3_f32_row_vbmi(&codes, &mut out) };
            assert_eq!(done, n);
            check_f32(&out, "byte tables");
            let mut words = vec![0xaaaau16; n];
            let whole = n / 64 * 64;
            // SAFETY: as above; one tile of whole vectors, `k = 0`.
            unsafe { x86::e4m3_bf16_tiles_vbmi(&codes[..whole], whole, &[0], &mut words[..whole]) };
            for (&c, &x) in codes.iter().zip(&words[..whole]) {
                assert_eq!(x, e4m3_bf16(c), "byte tables code {c:#04x}");
            }
        }
    }

    /// Every path widens every e4m3 code to [`e4m3_f32`]'s bits (NaNs with their sign),
    /// over rows of every length around the vector widths, codes in random order, the
    /// output poisoned first.
    #[test]
    fn e4m3_f32_rows_are_identical_on_every_path() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for len in (0..70).chain([128, 255, 256, 257, 1000]) {
            let mut codes: Vec<u8> = (0..len)
                .map(|i| if i < 256 { i as u8 } else { rng.gen() })
                .collect();
            for i in (1..len).rev() {
                codes.swap(i, rng.gen_range(0..=i));
            }
            for isa in CpuIsa::available() {
                let mut out = vec![f32::from_bits(0x7fa5_a5a5); len];
                e4m3_f32_row(isa, &codes, &mut out);
                for (&c, &x) in codes.iter().zip(&out) {
                    assert_eq!(
                        x.to_bits(),
                        e4m3_f32(c).to_bits(),
                        "{} code {c:#04x}",
                        isa.isa()
                    );
                }
            }
        }
    }

    /// Every path widens bf16 values to [`bf16_daz`]'s bits: every bit pattern (NaNs,
    /// infinities, subnormals of both signs), rows of every length around the vector
    /// widths, the output poisoned first.
    #[test]
    fn bf16_f32_rows_are_identical_on_every_path() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        let mut all: Vec<u16> = (0..=u16::MAX).collect();
        for i in (1..all.len()).rev() {
            all.swap(i, rng.gen_range(0..=i));
        }
        for len in (0..70).chain([255, 1000, 65536]) {
            let words = &all[..len];
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            for isa in CpuIsa::available() {
                let mut out = vec![f32::from_bits(0x7fa5_a5a5); len];
                bf16_f32_row(isa, &bytes, &mut out);
                for (&w, &x) in words.iter().zip(&out) {
                    assert_eq!(
                        x.to_bits(),
                        bf16_daz(w).to_bits(),
                        "{} bits {w:#06x}",
                        isa.isa()
                    );
                }
            }
        }
    }

    /// Every path widens every e4m3 code times every power of two to the f32 product's
    /// bits (flushed), over rows with tails.
    #[test]
    fn scaled_e4m3_rows_are_identical_on_every_path() {
        let codes: Vec<u8> = (0..=255u8).chain(0..=40).collect();
        for k in -127..=127 {
            let s = 2f32.powi(k);
            for isa in CpuIsa::available() {
                let mut out = vec![0xaaaau16; codes.len()];
                e4m3_row_pow2(isa, &codes, k, &mut out);
                for (&c, &x) in codes.iter().zip(&out) {
                    let want = (f32_daz(e4m3_f32(c) * s).to_bits() >> 16) as u16;
                    assert_eq!(x, want, "{} code {c:#04x} k {k}", isa.isa());
                }
            }
        }
    }

    /// Every path widens a row of tiles, each at its own power of two, to the f32
    /// products' bits (flushed): tiles of 64 and 128 (the byte tables on a VBMI CPU) and of
    /// 16 and 96 (tile by tile), exponents across and past the fast range, every code in
    /// random order, the output poisoned first.
    #[test]
    fn tiles_at_their_own_scales_are_identical_on_every_path() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for tile in [64, 128, 16, 96] {
            for _ in 0..40 {
                let nt = rng.gen_range(1..9);
                let mut codes: Vec<u8> = (0..tile * nt).map(|i| i as u8).collect();
                for i in (1..codes.len()).rev() {
                    codes.swap(i, rng.gen_range(0..=i));
                }
                let ks: Vec<i32> = (0..nt)
                    .map(|_| match rng.gen_range(0..6) {
                        0 => 0,
                        1 => -117,
                        2 => 119,
                        3 => rng.gen_range(-127..=127),
                        _ => rng.gen_range(-20..=20),
                    })
                    .collect();
                for isa in CpuIsa::available() {
                    let mut out = vec![0xaaaau16; codes.len()];
                    e4m3_tiles_pow2(isa, &codes, tile, &ks, &mut out);
                    for (i, (&c, &x)) in codes.iter().zip(&out).enumerate() {
                        let k = ks[i / tile];
                        let want = (f32_daz(e4m3_f32(c) * 2f32.powi(k)).to_bits() >> 16) as u16;
                        assert_eq!(x, want, "{} tile {tile} code {c:#04x} k {k}", isa.isa());
                    }
                }
            }
        }
    }

    /// Every path gives every fp4 byte at every scale byte, as f32, the scalar formula's
    /// bits (flushed subnormals at the low scales, infinities at the top ones, NaN at
    /// `0xff`), in rows of several groups, the output poisoned first.
    #[test]
    fn fp4_f32_groups_are_identical_on_every_path() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        let all: Vec<u8> = (0..=255).collect();
        for sb0 in (0..=255u8).step_by(3) {
            let scales: Vec<u8> = (0..16)
                .map(|g| sb0.wrapping_add(g as u8 * rng.gen_range(0..3)))
                .collect();
            let packed: Vec<u8> = (0..16 * scales.len())
                .map(|i| all[i % 256] ^ rng.gen::<u8>() & 0x11)
                .collect();
            for isa in CpuIsa::available() {
                let mut out = vec![f32::from_bits(0x7fa5_a5a5); 32 * scales.len()];
                fp4_f32_groups(isa, &packed, &scales, &mut out);
                for (i, &x) in out.iter().enumerate() {
                    let (g, j) = (i / 32, i % 32);
                    let b = packed[16 * g + j / 2];
                    let n = if j % 2 == 0 { b & 0xf } else { b >> 4 };
                    let want = f32_daz(e2m1_to_f32(n) * ue8m0_to_f32(scales[g]));
                    assert_eq!(
                        x.to_bits(),
                        want.to_bits(),
                        "{} sb {} code {n}",
                        isa.isa(),
                        scales[g]
                    );
                }
            }
        }
    }

    /// A row of fp4 groups at random scale bytes (the vector route's range, its ends and
    /// the bytes past them) gives each group's [`fp4_group`] bits, on every path.
    #[test]
    fn fp4_rows_of_groups_are_identical_on_every_path() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for groups in [1, 2, 4, 9] {
            let packed: Vec<u8> = (0..16 * groups).map(|_| rng.gen()).collect();
            let scales: Vec<u8> = (0..groups)
                .map(|_| [0, 1, 2, 127, 252, 253, 255, rng.gen()][rng.gen_range(0..8)])
                .collect();
            for isa in CpuIsa::available() {
                let mut out = vec![0xaaaau16; 32 * groups];
                fp4_groups(isa, &packed, &scales, &mut out);
                for (g, &sb) in scales.iter().enumerate() {
                    let mut want = [0u16; 32];
                    fp4_group_values(&packed[16 * g..][..16], sb, &mut want);
                    assert_eq!(out[32 * g..][..32], want, "{} group {g} sb {sb}", isa.isa());
                }
            }
        }
    }

    /// Every path widens every fp4 byte at every scale byte to [`fp4_bf16`]'s bits
    /// (subnormal products flushed, NaN scale, the ends of the scale range).
    #[test]
    fn fp4_groups_are_identical_on_every_path() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for sb in 0..=255u8 {
            for chunk in 0..16 {
                let mut packed = [0u8; 16];
                for (j, p) in packed.iter_mut().enumerate() {
                    *p = (chunk * 16 + j) as u8 ^ if chunk == 0 { 0 } else { rng.gen::<u8>() };
                }
                for isa in CpuIsa::available() {
                    let mut out = [0xaaaau16; 32];
                    fp4_group(isa, &packed, sb, &mut out);
                    for (j, &b) in packed.iter().enumerate() {
                        assert_eq!(
                            out[2 * j],
                            fp4_bf16(b & 0xf, sb),
                            "{} sb {sb} byte {b:#04x}",
                            isa.isa()
                        );
                        assert_eq!(
                            out[2 * j + 1],
                            fp4_bf16(b >> 4, sb),
                            "{} sb {sb} byte {b:#04x}",
                            isa.isa()
                        );
                    }
                }
            }
        }
    }
}
