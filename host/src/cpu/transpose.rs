//! f32 matrix transposes (exact: values are moved, never computed), for the epilogues that
//! read a GEMM's `Cᵀ` along its other dimension: 16 × 16 register tiles on AVX-512 (8 × 8
//! ones on the strips a dimension that is not a multiple of 16 leaves), 8 × 8 on AVX2,
//! element by element elsewhere and at the edges. Byte matrices ([`transpose_bytes`], fp8
//! keys before their decode) in 16 × 16 tiles, four (AVX-512) or two (AVX2) per register.

use super::dot::bf16_bits_daz;
use super::isa::{CpuIsa, Isa};

/// `dst[j·ldd + i] = src[i·lds + j]` for `i < m`, `j < n`. Panics if a slice is too short.
pub fn transpose(
    isa: CpuIsa,
    m: usize,
    n: usize,
    src: &[f32],
    lds: usize,
    dst: &mut [f32],
    ldd: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(lds >= n && ldd >= m);
    assert!(src.len() >= (m - 1) * lds + n && dst.len() >= (n - 1) * ldd + m);
    #[cfg(target_arch = "x86_64")]
    match isa.isa() {
        Isa::Amx | Isa::Avx512Bf16 | Isa::Avx512 => {
            let (m16, n16, m8, n8) = (m / 16 * 16, n / 16 * 16, m / 8 * 8, n / 8 * 8);
            // SAFETY: the path's CpuIsa exists only on a CPU with AVX-512F and AVX2
            // (`Isa::supported`); the slices hold the matrices (asserted above). The three
            // calls cover rows `0..m16` × columns `0..n16`, rows `0..m16` × columns
            // `n16..n8` and rows `m16..m8` × columns `0..n8`: every pointer offset below is
            // the first element of that sub-matrix (called only when it is not empty), inside both
            // slices.
            unsafe {
                let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
                x86::tiles16(m16, n16, s, lds, d, ldd);
                if n8 > n16 && m16 > 0 {
                    x86::tiles8(m16, n8 - n16, s.add(n16), lds, d.add(n16 * ldd), ldd);
                }
                if m8 > m16 && n8 > 0 {
                    x86::tiles8(m8 - m16, n8, s.add(m16 * lds), lds, d.add(m16), ldd);
                }
            }
            edges(m, n, m8, n8, src, lds, dst, ldd);
            return;
        }
        Isa::Avx2 => {
            // SAFETY: as above, with AVX2.
            unsafe { x86::tiles8(m, n, src.as_ptr(), lds, dst.as_mut_ptr(), ldd) };
            edges(m, n, m / 8 * 8, n / 8 * 8, src, lds, dst, ldd);
            return;
        }
        Isa::Scalar => {}
    }
    let _ = isa;
    edges(m, n, 0, 0, src, lds, dst, ldd);
}

/// `dst[j·ldd + i] = src[i·lds + j]` for bytes, `i < m`, `j < n`. Panics if a slice is
/// too short. A 16 × 16 byte tile takes as many shuffles as a 16 × 16 f32 one: moving fp8
/// codes before they are widened moves a quarter of the bits per shuffle.
pub fn transpose_bytes(
    isa: CpuIsa,
    m: usize,
    n: usize,
    src: &[u8],
    lds: usize,
    dst: &mut [u8],
    ldd: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(lds >= n && ldd >= m);
    assert!(src.len() >= (m - 1) * lds + n && dst.len() >= (n - 1) * ldd + m);
    #[cfg(target_arch = "x86_64")]
    {
        // Bytes per register row of the path's tiles.
        let width = match isa.isa() {
            Isa::Amx | Isa::Avx512Bf16 | Isa::Avx512 => Some(64),
            Isa::Avx2 => Some(32),
            Isa::Scalar => None,
        };
        if let Some(width) = width {
            let (mt, nt) = (m / 16 * 16, n / width * width);
            // SAFETY: the path's CpuIsa exists only on a CPU with its features (AVX-512BW,
            // AVX2: `Isa::supported`); the slices hold the matrices (asserted above) and
            // the tiles cover rows `0..mt` × columns `0..nt`.
            unsafe {
                let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
                if width == 64 {
                    x86::byte_tiles64(mt, nt, s, lds, d, ldd);
                } else {
                    x86::byte_tiles32(mt, nt, s, lds, d, ldd);
                }
            }
            edges(m, n, mt, nt, src, lds, dst, ldd);
            return;
        }
    }
    let _ = isa;
    edges(m, n, 0, 0, src, lds, dst, ldd);
}

/// Keys as bf16 pairs along the columns, from gathered rows: `dst[p·ldd + j]` = the
/// 32-bit word of elements `2p` (low half) and `2p + 1` (high half) of `rows[j]`, for `p <
/// k2` and `j < rows.len()`, each bf16 subnormal flushed to signed zero (as
/// [`super::dot::bf16_daz`] reads it); the columns from `rows.len()` up to the next
/// multiple of 16 are zeroed. Returns whether some value was a subnormal. 16 × 16 register
/// tiles on the AVX-512 paths, element by element elsewhere and on the pairs a `k2` that is
/// not a multiple of 16 leaves. Panics if a row is shorter than `2·k2` elements, or `dst`
/// than `k2` rows of `ldd ≥` the padded column count.
pub fn pair_rows_daz(isa: CpuIsa, rows: &[&[u16]], k2: usize, dst: &mut [u32], ldd: usize) -> bool {
    let n = rows.len();
    let cols = n.div_ceil(16) * 16;
    if k2 == 0 || cols == 0 {
        return false;
    }
    assert!(ldd >= cols && dst.len() >= (k2 - 1) * ldd + cols);
    assert!(rows.iter().all(|r| r.len() >= 2 * k2));
    let mut p0 = 0;
    let mut sub = false;
    #[cfg(target_arch = "x86_64")]
    if isa.isa().avx512() {
        p0 = k2 / 16 * 16;
        if p0 > 0 {
            // SAFETY: the path's CpuIsa exists only on a CPU with AVX-512F and BW
            // (`Isa::supported`); every row holds `2·k2 ≥ 2·p0` elements and `dst` the
            // padded columns of `k2 ≥ p0` rows (asserted above).
            sub = unsafe { x86::pair_tiles16(rows, p0, dst.as_mut_ptr(), ldd) };
        }
    }
    let _ = isa;
    for p in p0..k2 {
        let out = &mut dst[p * ldd..][..cols];
        for (j, o) in out.iter_mut().enumerate() {
            *o = match rows.get(j) {
                Some(r) => {
                    let (lo, s0) = bf16_bits_daz(r[2 * p]);
                    let (hi, s1) = bf16_bits_daz(r[2 * p + 1]);
                    sub |= s0 | s1;
                    lo as u32 | (hi as u32) << 16
                }
                None => 0,
            };
        }
    }
    sub
}

/// The elements outside the tiled `mt × nt` corner.
#[allow(clippy::too_many_arguments)]
fn edges<T: Copy>(
    m: usize,
    n: usize,
    mt: usize,
    nt: usize,
    src: &[T],
    lds: usize,
    dst: &mut [T],
    ldd: usize,
) {
    // Rows of the tiled corner: their columns past it (none when the tiles cover them:
    // then no row is visited at all).
    if nt < n {
        for i in 0..mt {
            for j in nt..n {
                dst[j * ldd + i] = src[i * lds + j];
            }
        }
    }
    for i in mt..m {
        for j in 0..n {
            dst[j * ldd + i] = src[i * lds + j];
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(
    clippy::incompatible_msrv,
    reason = "AVX-512 intrinsics need Rust 1.89, as the AVX-512 target features already do"
)]
mod x86 {
    use std::arch::x86_64::*;

    use crate::cpu::raw;

    /// The 16 × 16 byte transposes of every 128-bit lane of 16 rows: `r[k]`'s lane `l` is
    /// row `k`, columns `16l..16l + 16`; returns `o` with `o[c]`'s lane `l` = column
    /// `16l + c`, rows `0..16`. Interleaves of bytes, words, dwords, qwords (in-lane
    /// unpacks only); generic over the register (`__m512i` or `__m256i`) through the
    /// four unpacks given.
    #[inline(always)]
    fn lanes16<V: Copy>(
        r: [V; 16],
        u8s: impl Fn(V, V) -> (V, V),
        u16s: impl Fn(V, V) -> (V, V),
        u32s: impl Fn(V, V) -> (V, V),
        u64s: impl Fn(V, V) -> (V, V),
    ) -> [V; 16] {
        // After the byte step, t[2k] holds rows 2k, 2k+1 at columns 0..8 (byte pairs),
        // t[2k+1] at columns 8..16.
        let mut t = r;
        for k in 0..8 {
            (t[2 * k], t[2 * k + 1]) = u8s(r[2 * k], r[2 * k + 1]);
        }
        // u[4k + q]: rows 4k..4k+4 (4-byte groups) at columns 4q..4q+4.
        let mut u = t;
        for k in 0..4 {
            (u[4 * k], u[4 * k + 1]) = u16s(t[4 * k], t[4 * k + 2]);
            (u[4 * k + 2], u[4 * k + 3]) = u16s(t[4 * k + 1], t[4 * k + 3]);
        }
        // v[8h + 2q + e]: rows 8h..8h+8 (8-byte groups) at columns 4q + 2e, 4q + 2e + 1.
        let mut v = u;
        for h in 0..2 {
            for q in 0..4 {
                (v[8 * h + 2 * q], v[8 * h + 2 * q + 1]) = u32s(u[8 * h + q], u[8 * h + 4 + q]);
            }
        }
        // o[c]: rows 0..16 at column c.
        let mut o = v;
        for g in 0..8 {
            let (lo, hi) = u64s(v[g], v[8 + g]);
            // v[g] covers columns 2g and 2g + 1 (g = 2q + e: 4q + 2e = 2g).
            o[2 * g] = lo;
            o[2 * g + 1] = hi;
        }
        o
    }

    /// Every whole tile of 16 rows × `16·L` bytes: `load` reads a row's `16·L` bytes into a
    /// register of `L` 128-bit lanes, [`lanes16`] transposes each lane, `store` writes a
    /// register's lanes to the `L` addresses given (lane `l` of output `c`: row
    /// `16l + c` of `dst`).
    ///
    /// # Safety
    /// `load` and `store` are sound for the path that calls; `src` holds `m` rows of `lds`
    /// bytes, `dst` `n` rows of `ldd`; `m % 16 == 0`, `n % (16·L) == 0`.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn byte_tiles<V: Copy, const L: usize>(
        (m, n): (usize, usize),
        src: *const u8,
        lds: usize,
        dst: *mut u8,
        ldd: usize,
        load: impl Fn(*const u8) -> V,
        transpose: impl Fn([V; 16]) -> [V; 16],
        store: impl Fn(V, [*mut u8; L]),
    ) {
        for i0 in (0..m).step_by(16) {
            for j0 in (0..n).step_by(16 * L) {
                // SAFETY: rows i0..i0+16 ≤ m, columns j0..j0+16·L ≤ n of src; rows
                // j0..j0+16·L of dst at columns i0..i0+16 likewise.
                unsafe {
                    let r: [V; 16] = std::array::from_fn(|k| load(src.add((i0 + k) * lds + j0)));
                    for (c, &x) in transpose(r).iter().enumerate() {
                        store(
                            x,
                            std::array::from_fn(|l| dst.add((j0 + 16 * l + c) * ldd + i0)),
                        );
                    }
                }
            }
        }
    }

    /// [`byte_tiles`] of 16 rows × 64 bytes (four 16 × 16 byte transposes per register).
    ///
    /// # Safety
    /// AVX-512F and AVX-512BW; as [`byte_tiles`] with `n % 64 == 0`.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn byte_tiles64(
        m: usize,
        n: usize,
        src: *const u8,
        lds: usize,
        dst: *mut u8,
        ldd: usize,
    ) {
        // SAFETY: the loads read 64 bytes and the stores write 16 at the addresses
        // `byte_tiles` gives (inside the matrices, its contract); AVX-512BW is enabled.
        unsafe {
            byte_tiles::<__m512i, 4>(
                (m, n),
                src,
                lds,
                dst,
                ldd,
                |p| raw::read::<__m512i>(p.cast()),
                |r| {
                    lanes16(
                        r,
                        |a, b| (_mm512_unpacklo_epi8(a, b), _mm512_unpackhi_epi8(a, b)),
                        |a, b| (_mm512_unpacklo_epi16(a, b), _mm512_unpackhi_epi16(a, b)),
                        |a, b| (_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b)),
                        |a, b| (_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b)),
                    )
                },
                |x, at| {
                    raw::write::<__m128i>(at[0].cast(), _mm512_extracti32x4_epi32::<0>(x));
                    raw::write::<__m128i>(at[1].cast(), _mm512_extracti32x4_epi32::<1>(x));
                    raw::write::<__m128i>(at[2].cast(), _mm512_extracti32x4_epi32::<2>(x));
                    raw::write::<__m128i>(at[3].cast(), _mm512_extracti32x4_epi32::<3>(x));
                },
            )
        }
    }

    /// [`byte_tiles`] of 16 rows × 32 bytes (two 16 × 16 byte transposes per register).
    ///
    /// # Safety
    /// AVX2; as [`byte_tiles`] with `n % 32 == 0`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn byte_tiles32(
        m: usize,
        n: usize,
        src: *const u8,
        lds: usize,
        dst: *mut u8,
        ldd: usize,
    ) {
        // SAFETY: as in `byte_tiles64`, 32-byte loads; AVX2 is enabled.
        unsafe {
            byte_tiles::<__m256i, 2>(
                (m, n),
                src,
                lds,
                dst,
                ldd,
                |p| raw::read::<__m256i>(p.cast()),
                |r| {
                    lanes16(
                        r,
                        |a, b| (_mm256_unpacklo_epi8(a, b), _mm256_unpackhi_epi8(a, b)),
                        |a, b| (_mm256_unpacklo_epi16(a, b), _mm256_unpackhi_epi16(a, b)),
                        |a, b| (_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b)),
                        |a, b| (_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b)),
                    )
                },
                |x, at| {
                    raw::write::<__m128i>(at[0].cast(), _mm256_castsi256_si128(x));
                    raw::write::<__m128i>(at[1].cast(), _mm256_extracti128_si256::<1>(x));
                },
            )
        }
    }

    /// Every whole 16 × 16 tile.
    ///
    /// # Safety
    /// AVX-512F; `src` holds `m` rows of `lds`, `dst` `n` rows of `ldd`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn tiles16(
        m: usize,
        n: usize,
        src: *const f32,
        lds: usize,
        dst: *mut f32,
        ldd: usize,
    ) {
        for i0 in (0..m / 16 * 16).step_by(16) {
            for j0 in (0..n / 16 * 16).step_by(16) {
                // SAFETY: rows i0..i0+16 ≤ m, columns j0..j0+16 ≤ n of src; the transposed
                // tile in dst likewise.
                unsafe {
                    let mut r = [_mm512_setzero_ps(); 16];
                    for (k, x) in r.iter_mut().enumerate() {
                        *x = raw::read::<__m512>(src.add((i0 + k) * lds + j0).cast());
                    }
                    let t = transpose16(r);
                    for (k, x) in t.iter().enumerate() {
                        raw::write::<__m512>(dst.add((j0 + k) * ldd + i0).cast(), *x);
                    }
                }
            }
        }
    }

    /// [`super::pair_rows_daz`]'s tiles: pairs `0..k2` of every row (16 rows at a time,
    /// missing rows read as zeros), subnormals flushed; whether one was.
    ///
    /// # Safety
    /// AVX-512F and BW; every row holds `2·k2` elements, `dst` `k2` rows of `ldd` elements
    /// from `rows.len()` rounded up to 16 columns; `k2` a multiple of 16.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn pair_tiles16(
        rows: &[&[u16]],
        k2: usize,
        dst: *mut u32,
        ldd: usize,
    ) -> bool {
        let exponent = _mm512_set1_epi16(0x7f80);
        let mantissa = _mm512_set1_epi16(0x007f);
        let sign = _mm512_set1_epi16(0x8000u16 as i16);
        let mut sub: u32 = 0;
        for (g, group) in rows.chunks(16).enumerate() {
            for p0 in (0..k2).step_by(16) {
                // SAFETY: each row holds pairs `p0..p0 + 16 ≤ k2` (32 elements from
                // `2·p0`); the tile's 16 destination rows `p0..p0 + 16` hold columns
                // `16g..16g + 16` (the caller's contract).
                unsafe {
                    // A constant trip count (missing rows zero), so that the rows stay in
                    // registers (with the group's length as the count they went through the
                    // stack).
                    let mut r = [_mm512_setzero_ps(); 16];
                    for (k, x) in r.iter_mut().enumerate() {
                        if let Some(row) = group.get(k) {
                            *x = raw::read::<__m512>(row.as_ptr().add(2 * p0).cast());
                        }
                    }
                    let t = transpose16(r);
                    for (k, x) in t.iter().enumerate() {
                        let v = _mm512_castps_si512(*x);
                        let zero_exp = _mm512_testn_epi16_mask(v, exponent);
                        sub |= _mm512_mask_test_epi16_mask(zero_exp, v, mantissa);
                        raw::write::<__m512i>(dst.add((p0 + k) * ldd + 16 * g).cast(), v);
                    }
                }
            }
        }
        if sub != 0 {
            // Rare: flush the subnormals (a second pass over the tiles written).
            for p in 0..k2 {
                for g in 0..rows.len().div_ceil(16) {
                    // SAFETY: row `p < k2` of `dst`, columns `16g..16g + 16` (as above).
                    unsafe {
                        let at = dst.add(p * ldd + 16 * g).cast::<__m512i>();
                        let v = raw::read(at);
                        let zero_exp = _mm512_testn_epi16_mask(v, exponent);
                        raw::write(
                            at,
                            _mm512_mask_mov_epi16(v, zero_exp, _mm512_and_si512(v, sign)),
                        );
                    }
                }
            }
        }
        sub != 0
    }

    /// A 16 × 16 transpose in registers.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
        let mut t = [_mm512_setzero_ps(); 16];
        for k in 0..8 {
            t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
            t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
        }
        let mut u = [_mm512_setzero_ps(); 16];
        for k in 0..4 {
            let (a, b, c, d) = (t[4 * k], t[4 * k + 1], t[4 * k + 2], t[4 * k + 3]);
            u[4 * k] = _mm512_shuffle_ps::<0x44>(a, c);
            u[4 * k + 1] = _mm512_shuffle_ps::<0xee>(a, c);
            u[4 * k + 2] = _mm512_shuffle_ps::<0x44>(b, d);
            u[4 * k + 3] = _mm512_shuffle_ps::<0xee>(b, d);
        }
        // u[4k + c] holds rows 4k..4k+4, column c (mod 4) of every 128-bit lane.
        let mut v = [_mm512_setzero_ps(); 16];
        for c in 0..4 {
            v[c] = _mm512_shuffle_f32x4::<0x88>(u[c], u[4 + c]);
            v[4 + c] = _mm512_shuffle_f32x4::<0xdd>(u[c], u[4 + c]);
            v[8 + c] = _mm512_shuffle_f32x4::<0x88>(u[8 + c], u[12 + c]);
            v[12 + c] = _mm512_shuffle_f32x4::<0xdd>(u[8 + c], u[12 + c]);
        }
        let mut o = [_mm512_setzero_ps(); 16];
        for c in 0..4 {
            o[c] = _mm512_shuffle_f32x4::<0x88>(v[c], v[8 + c]);
            o[8 + c] = _mm512_shuffle_f32x4::<0xdd>(v[c], v[8 + c]);
            o[4 + c] = _mm512_shuffle_f32x4::<0x88>(v[4 + c], v[12 + c]);
            o[12 + c] = _mm512_shuffle_f32x4::<0xdd>(v[4 + c], v[12 + c]);
        }
        o
    }

    /// Every whole 8 × 8 tile.
    ///
    /// # Safety
    /// AVX2; as [`tiles16`].
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn tiles8(
        m: usize,
        n: usize,
        src: *const f32,
        lds: usize,
        dst: *mut f32,
        ldd: usize,
    ) {
        for i0 in (0..m / 8 * 8).step_by(8) {
            for j0 in (0..n / 8 * 8).step_by(8) {
                // SAFETY: as in `tiles16`, for 8 × 8 tiles.
                unsafe {
                    let mut r = [_mm256_setzero_ps(); 8];
                    for (k, x) in r.iter_mut().enumerate() {
                        *x = raw::read::<__m256>(src.add((i0 + k) * lds + j0).cast());
                    }
                    let mut t = [_mm256_setzero_ps(); 8];
                    for k in 0..4 {
                        t[2 * k] = _mm256_unpacklo_ps(r[2 * k], r[2 * k + 1]);
                        t[2 * k + 1] = _mm256_unpackhi_ps(r[2 * k], r[2 * k + 1]);
                    }
                    let mut u = [_mm256_setzero_ps(); 8];
                    for k in 0..2 {
                        let (a, b, c, d) = (t[4 * k], t[4 * k + 1], t[4 * k + 2], t[4 * k + 3]);
                        u[4 * k] = _mm256_shuffle_ps::<0x44>(a, c);
                        u[4 * k + 1] = _mm256_shuffle_ps::<0xee>(a, c);
                        u[4 * k + 2] = _mm256_shuffle_ps::<0x44>(b, d);
                        u[4 * k + 3] = _mm256_shuffle_ps::<0xee>(b, d);
                    }
                    for c in 0..4 {
                        let lo = _mm256_permute2f128_ps::<0x20>(u[c], u[4 + c]);
                        let hi = _mm256_permute2f128_ps::<0x31>(u[c], u[4 + c]);
                        raw::write::<__m256>(dst.add((j0 + c) * ldd + i0).cast(), lo);
                        raw::write::<__m256>(dst.add((j0 + 4 + c) * ldd + i0).cast(), hi);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_path_transposes_every_shape() {
        for (m, n) in [
            (1, 1),
            (16, 16),
            (64, 64),
            (37, 70),
            (8, 24),
            (17, 9),
            (64, 8),
            (8, 64),
            (40, 56),
            (5, 128),
        ] {
            let (lds, ldd) = (n + 3, m + 5);
            let src: Vec<f32> = (0..m * lds).map(|i| i as f32).collect();
            for isa in CpuIsa::available() {
                let mut dst = vec![-1.0; n * ldd];
                transpose(isa, m, n, &src, lds, &mut dst, ldd);
                for i in 0..m {
                    for j in 0..n {
                        assert_eq!(dst[j * ldd + i], src[i * lds + j], "{} {m}×{n}", isa.isa());
                    }
                }
                for j in 0..n {
                    assert!(dst[j * ldd + m..(j + 1) * ldd].iter().all(|&x| x == -1.0));
                }
            }
        }
    }

    /// Pairs of gathered bf16 rows on every path: whole tiles and edges (pairs not a
    /// multiple of 16, rows not a multiple of 16: the pad columns zeroed), rows at odd
    /// offsets, subnormals flushed to signed zero and reported, zeros left alone.
    #[test]
    fn every_path_pairs_gathered_rows() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for (n, k2, subnormals) in [
            (1, 1, false),
            (16, 16, true),
            (64, 144, false),
            (64, 144, true),
            (37, 21, true),
            (128, 256, false),
            (5, 40, true),
        ] {
            let len = 2 * k2 + 3;
            let mut data: Vec<u16> = (0..n * len + 1).map(|_| rng.gen()).collect();
            // Exact zeros are not subnormals.
            let size = data.len();
            data[rng.gen_range(0..size)] = 0x8000;
            data[rng.gen_range(0..size)] = 0;
            // Without subnormals: every exponent nonzero; else one planted in some row.
            if !subnormals {
                for x in data
                    .iter_mut()
                    .filter(|x| **x & 0x7f80 == 0 && **x & 0x7f != 0)
                {
                    *x |= 0x0080;
                }
            } else {
                let r = rng.gen_range(0..n);
                data[1 + r * len + rng.gen_range(0..2 * k2)] = 0x8001;
            }
            // Rows from an odd element offset (2-byte, not 4-byte, aligned).
            let rows: Vec<&[u16]> = (0..n).map(|r| &data[1 + r * len..][..len]).collect();
            let cols = n.div_ceil(16) * 16;
            let ldd = cols + 16;
            for isa in CpuIsa::available() {
                let mut dst = vec![0xdead_beefu32; k2 * ldd];
                let sub = pair_rows_daz(isa, &rows, k2, &mut dst, ldd);
                assert_eq!(sub, subnormals, "{} {n}×{k2}", isa.isa());
                for p in 0..k2 {
                    for j in 0..cols {
                        let want = rows.get(j).map_or(0, |r| {
                            let f = |b: u16| if b & 0x7f80 == 0 { b & 0x8000 } else { b } as u32;
                            f(r[2 * p]) | f(r[2 * p + 1]) << 16
                        });
                        assert_eq!(dst[p * ldd + j], want, "{} {n}×{k2} ({p}, {j})", isa.isa());
                    }
                    assert!(dst[p * ldd + cols..(p + 1) * ldd]
                        .iter()
                        .all(|&x| x == 0xdead_beef));
                }
            }
        }
    }

    /// Byte transposes on every path: whole tiles of both widths, edges on each side,
    /// strides wider than the matrices, random bytes; nothing written outside.
    #[test]
    fn every_path_transposes_bytes_of_every_shape() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        for (m, n) in [
            (1, 1),
            (16, 16),
            (16, 64),
            (128, 64),
            (64, 128),
            (37, 70),
            (17, 33),
            (15, 64),
            (48, 96),
            (5, 128),
            (128, 7),
        ] {
            let (lds, ldd) = (n + rng.gen_range(0..5), m + rng.gen_range(0..5));
            let src: Vec<u8> = (0..m * lds).map(|_| rng.gen()).collect();
            for isa in CpuIsa::available() {
                let mut dst = vec![0xa5u8; n * ldd];
                let before = dst.clone();
                transpose_bytes(isa, m, n, &src, lds, &mut dst, ldd);
                for i in 0..m {
                    for j in 0..n {
                        assert_eq!(dst[j * ldd + i], src[i * lds + j], "{} {m}×{n}", isa.isa());
                    }
                }
                for j in 0..n {
                    assert_eq!(
                        dst[j * ldd + m..(j + 1) * ldd],
                        before[j * ldd + m..(j + 1) * ldd]
                    );
                }
            }
        }
    }
}
