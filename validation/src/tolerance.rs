//! The tolerance table (one place for every op × quantity × dtype, keyed by enums), the
//! error statistics that judge an output against its reference, and the judges shared by
//! the suite and the golden-file checks.
//!
//! An element passes when `|got - ref| <= atol · magnitude + rtol · |ref|`, where
//! `magnitude` is a per-element error scale computed by the reference (documented per row
//! in [`Tolerance::basis`]). NaN in an output never passes; infinities must match exactly.
//!
//! # The sparse MLA `out` bound (derived, not fitted)
//!
//! The GPU kernel (as FlashMLA) rounds each probability to bf16 before `P·V`, and
//! normalises by the sum of the weights it used. Write the exact result
//! `o_c = Σ_j w_j v_jc` (`w_j = e^{S_j} / Σ_k e^{S_k}`) and `A_c = Σ_j w_j |v_jc|`.
//!
//! 1. **P rounded to bf16.** Each `p̃_j = p_j (1 + δ_j)`, `|δ_j| ≤ u = 2^-8` (8 significant
//!    bits, round to nearest). The kernel divides by a sum of roundings too,
//!    `Σ_k p_k (1 + η_k)`, `|η_k| ≤ u` (for bf16 KV `η = δ`; for fp8_ds_mla the tile scale
//!    is multiplied in before the rounding, which changes nothing here). So each weight is
//!    `w_j (1 + δ_j) / (1 + η̄)` with `η̄` a weighted mean of the `η`, and
//!    `|w̃_j − w_j| ≤ w_j · |δ_j − η̄| / (1 − u) ≤ w_j · 2u / (1 − u)`; summed against `v`:
//!    **`|õ_c − o_c| ≤ 2u/(1−u) · A_c`** ([`MLA_P_ROUNDING`] = `2^-7 / (1 − 2^-8)`). The
//!    bound is reached when the keys whose weights round up and those whose weights round
//!    down carry opposite values (near-cancellation: `o_c ≈ 0` while `A_c` is not); no
//!    bound in terms of `|o_c|` alone can hold, and a bound in `max |v|` is loose for
//!    ordinary data. The suite's cancellation case builds weights at bf16 rounding
//!    midpoints against latents `±V`.
//! 2. **Scores.** A score error `|ε_j| ≤ E_s` scales each weight by `e^{ε_j}` before the
//!    normalisation: `|w'_j − w_j| ≤ w_j (e^{2 E_s} − 1)`, so the error is at most
//!    `(e^{2E_s} − 1) · A_c`, and term 1 applies to `w'` (`A'_c ≤ (1 + 2E_s) A_c` to first
//!    order). `E_s` is the score budget of the `lse` row: `2e-5 · lse_magnitude`.
//! 3. **f32 accumulation** of `O = Σ p̃_j v_j` (n products), of the per-block rescaling
//!    and of the normalising sum: at most `(3n + 2) · 2^-23 · A_c` for `n` valid slots
//!    (2^-23: tensor cores may truncate rather than round).
//! 4. **Underflow.** Below 2^-126 f32 and bf16 keep only absolute precision (subnormals
//!    2^-149 and 2^-133 apart): a rounded weight, a product `p̃_j v_jc` (for fp8_ds_mla
//!    the weight times the tile scale, then times a code ≤ 448, scales ≥ 2^-14) and the
//!    output each lose at most `2^-134 · 2^14 · max|v|`: in all at most
//!    `U = (n + 1) · 2^-120 · max_j |v_j|` (only visible on outputs near 1e-38).
//! 5. **The bf16 output** adds `2^-8 · |o_c|`: the row's `rtol`.
//!
//! The row is `atol = 2u/(1−u)`, `rtol = 2^-8`, and the magnitude folds terms 2–4 in
//! ([`mla_out_magnitude`]): `mag = A_c · [(1 + 2E_s) + ((e^{2E_s} − 1) + (3n + 2)·2^-23) /
//! atol] + U / atol`, so that `atol · mag` is exactly the sum of terms 1–4 (U including
//! the bf16 dot product's flushes, below). The CPU backend rounds P to bf16 too (on every
//! vector path, for one arithmetic on all of them) but normalises by the f32 sum of the
//! unrounded weights (`η = 0`: at most `u · A_c`, half of term 1); the emulator and the
//! GPU use the bound fully on the cancellation case.
//!
//! # The CPU's bf16 dot product (`vdpbf16ps`, the `avx512bf16` path)
//!
//! `vdpbf16ps` does **not** round the products nor add a pair with one rounding: per
//! 32-bit lane it performs two FMAs, the odd element of the pair first, each `round(acc +
//! a·b)` to nearest even (a bf16 × bf16 product is exact in f32), with denormals-are-zero
//! on its inputs and flush-to-zero on each step's result (Intel's SDM; checked bit for bit
//! on the machine by `sparsekit_host::cpu::dot`'s tests). The CPU's f32 paths run the same
//! FMAs in the same order on the same (bf16, subnormals flushed) operands, so the
//! accumulation terms above — term 3, and the f32 dot of the indexer row — are those of
//! an f32 FMA chain whichever path runs: the instruction changes no `atol` or `rtol`.
//! What it adds is its flush: a partial sum in the f32 subnormal range becomes zero, an
//! absolute error below 2^-126 per step ([`DOT_FLUSH`]). The table takes it as an
//! absolute term of `steps · 2^-126` per dot product, folded into the magnitudes
//! ([`dot_flush_magnitude`]): `n + 1` steps for an `out` element (term 4's `U`, divided
//! by a normaliser ≥ 1), `d + 1` per head for an indexer logit (times `|w_h|` and the key
//! scale) and per score for the `lse` magnitude (times the softmax scale). Each is below
//! 1e-34 and only visible on data whose dot products are themselves near 1e-38.

use std::fmt;

use serde::Serialize;
use sparsekit_host::layout::{IndexKDtype, KvDtype, PageLayout};
use sparsekit_host::ops::Op;
use sparsekit_host::Error;

/// The output of an op a tolerance row (and a suite record) is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Quantity {
    /// The cache bytes a store wrote.
    Cache,
    /// Indexer logits.
    Logits,
    /// Top-k positions or slots.
    Indices,
    /// Attention output.
    Out,
    /// Attention log-sum-exp.
    Lse,
    /// Copied pages.
    Pages,
    /// Page checksums.
    Checksums,
    /// Raw output bits (batch-invariance checks: bit-identical or not).
    Bits,
    /// Nothing compared (the backend returned an error).
    None,
}

impl Quantity {
    /// snake_case name.
    pub fn name(self) -> &'static str {
        match self {
            Quantity::Cache => "cache",
            Quantity::Logits => "logits",
            Quantity::Indices => "indices",
            Quantity::Out => "out",
            Quantity::Lse => "lse",
            Quantity::Pages => "pages",
            Quantity::Checksums => "checksums",
            Quantity::Bits => "bits",
            Quantity::None => "-",
        }
    }
}

impl fmt::Display for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The dtype column of the table: the cache dtype of a case, or the element type of an
/// op that has none.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DataType {
    /// fp8 e4m3 index keys (either scale format).
    Fp8E4m3,
    /// bf16 index keys or KV.
    Bf16,
    /// FlashMLA's fp8 KV format.
    Fp8DsMla,
    /// fp4 (e2m1, ue8m0 group scales) index keys.
    Fp4E2m1,
    /// DeepSeek-V4's MODEL1 fp8 KV format.
    Model1Fp8,
    /// f32 logits (top-k).
    Fp32,
    /// Raw page bytes (copies).
    Bytes,
    /// u64 checksums.
    U64,
}

impl DataType {
    /// snake_case name.
    pub fn name(self) -> &'static str {
        match self {
            DataType::Fp8E4m3 => "fp8_e4m3",
            DataType::Bf16 => "bf16",
            DataType::Fp8DsMla => "fp8_ds_mla",
            DataType::Fp4E2m1 => "fp4_e2m1",
            DataType::Model1Fp8 => "model1_fp8",
            DataType::Fp32 => "fp32",
            DataType::Bytes => "bytes",
            DataType::U64 => "u64",
        }
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl From<IndexKDtype> for DataType {
    fn from(d: IndexKDtype) -> Self {
        match d {
            IndexKDtype::Fp8E4m3 { .. } => DataType::Fp8E4m3,
            IndexKDtype::Bf16 => DataType::Bf16,
            IndexKDtype::Fp4E2m1 => DataType::Fp4E2m1,
        }
    }
}

impl From<KvDtype> for DataType {
    fn from(d: KvDtype) -> Self {
        match d {
            KvDtype::Bf16 | KvDtype::Bf16x512 => DataType::Bf16,
            KvDtype::Fp8DsMla => DataType::Fp8DsMla,
            KvDtype::Model1Fp8 => DataType::Model1Fp8,
        }
    }
}

impl From<PageLayout> for DataType {
    fn from(l: PageLayout) -> Self {
        match l {
            PageLayout::IndexK(l) => l.dtype().into(),
            PageLayout::Kv(l) => l.dtype().into(),
        }
    }
}

/// Allowed error of one quantity of one op for one dtype.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Tolerance {
    pub op: Op,
    pub quantity: Quantity,
    pub dtype: DataType,
    /// Multiplies the reference's per-element magnitude.
    pub atol: f64,
    /// Multiplies |ref|.
    pub rtol: f64,
    /// What the magnitude is.
    pub basis: &'static str,
}

impl Tolerance {
    /// The bound in words: `exact`, or `atol·mag + rtol·|ref|`.
    pub fn describe(&self) -> String {
        if self.atol == 0.0 && self.rtol == 0.0 {
            "exact".into()
        } else {
            format!("{:.2e}·mag + {:.2e}·|ref|", self.atol, self.rtol)
        }
    }
}

const EXACT: &str = "exact: bytes / indices must be identical";
const INDEXER: &str = "magnitude = Σ_h |w_h|·(Σ_d |q_hd·k_d| + (d+1)·2^-126/atol)·scale (f32 dot of 128 + head sum; the bf16 dot product's flushes)";
const MLA_OUT: &str = "atol = 2u/(1-u) for P rounded to bf16 (u = 2^-8); magnitude = A·[(1 + 2E) + (e^{2E} - 1 + (3n+2)·2^-23)/atol] + (n+1)·2^-120·max|v|/atol, A = Σ_j w_j|v_j|, E = 2e-5·lse magnitude, n valid slots; rtol = bf16 output rounding (2^-8)";
const MLA_LSE: &str = "magnitude = softmax_scale · (max_j Σ_d |q_d·k_jd| + (d+1)·2^-126/atol)";

/// Unit roundoff of bf16 (8 significant bits, round to nearest): `|bf16(x) − x| ≤ 2^-8·|x|`.
pub const BF16_UNIT_ROUNDOFF: f64 = 1.0 / 256.0;

/// The sparse MLA `out` row's `atol`: `2u/(1 − u)` with `u` = [`BF16_UNIT_ROUNDOFF`], the
/// error of weights rounded to bf16 before `P·V`, per unit of `A_c` (module docs, term 1).
pub const MLA_P_ROUNDING: f64 = 2.0 * BF16_UNIT_ROUNDOFF / (1.0 - BF16_UNIT_ROUNDOFF);

/// The sparse MLA `lse` row's `atol`: the score error per unit of the lse magnitude.
pub const MLA_LSE_ATOL: f64 = 2e-5;

/// The indexer `logits` rows' `atol`.
pub const INDEXER_ATOL: f64 = 2e-5;

/// The largest error one step of the CPU's bf16 dot product adds by flushing a subnormal
/// partial sum to zero (module docs): 2^-126.
pub const DOT_FLUSH: f64 = 1.0 / (1u128 << 126) as f64;

/// The flushes of a dot product of `steps` steps, as a magnitude of a row with `atol`
/// (`atol · magnitude = steps · 2^-126`).
pub fn dot_flush_magnitude(steps: usize, atol: f64) -> f64 {
    steps as f64 * DOT_FLUSH / atol
}

/// The magnitude of a sparse MLA output element (module docs): `abs_out` = `A_c =
/// Σ_j w_j |v_jc|`, `lse_magnitude` its head's score scale, `n_valid` its token's valid
/// slots, `v_max` the largest |latent| of those slots. `MLA_P_ROUNDING · magnitude` is the
/// sum of the P-rounding, score, f32 accumulation and underflow terms of the derived
/// bound (the underflow term with the bf16 dot product's flushes).
pub fn mla_out_magnitude(abs_out: f64, lse_magnitude: f64, n_valid: usize, v_max: f64) -> f64 {
    MlaOutScale::new(lse_magnitude, n_valid, v_max).of(abs_out)
}

/// [`mla_out_magnitude`] with the terms shared by a head's elements computed once (its
/// `exp_m1` among them): `of(abs_out)` gives the same bits as `mla_out_magnitude`.
#[derive(Clone, Copy, Debug)]
pub struct MlaOutScale {
    /// Multiplies `A_c`.
    factor: f64,
    /// Added to it (the underflow term).
    floor: f64,
}

impl MlaOutScale {
    /// The head's terms: `lse_magnitude`, `n_valid` and `v_max` as in [`mla_out_magnitude`].
    pub fn new(lse_magnitude: f64, n_valid: usize, v_max: f64) -> Self {
        let n = n_valid as f64;
        let score = 2.0 * MLA_LSE_ATOL * lse_magnitude;
        const TWO_M23: f64 = 1.0 / 8_388_608.0;
        const TWO_M120: f64 = TWO_M23 * TWO_M23 * TWO_M23 * TWO_M23 * TWO_M23 / 32.0;
        let accumulation = (3.0 * n + 2.0) * TWO_M23;
        let underflow = (n + 1.0) * (TWO_M120 * v_max + DOT_FLUSH);
        MlaOutScale {
            factor: (1.0 + score) + (score.exp_m1() + accumulation) / MLA_P_ROUNDING,
            floor: underflow / MLA_P_ROUNDING,
        }
    }

    /// The magnitude of an element whose `A_c` is `abs_out`.
    pub fn of(&self, abs_out: f64) -> f64 {
        abs_out * self.factor + self.floor
    }
}

/// Every tolerance, in one table.
pub const TABLE: &[Tolerance] = {
    use DataType::*;
    use Op::*;
    use Quantity::{Cache, Checksums, Indices, Logits, Out};
    &[
        row(IndexKStore, Cache, Fp8E4m3, 0.0, 0.0, EXACT),
        row(IndexKStore, Cache, Bf16, 0.0, 0.0, EXACT),
        row(IndexKStore, Cache, Fp4E2m1, 0.0, 0.0, EXACT),
        row(KvStore, Cache, Fp8DsMla, 0.0, 0.0, EXACT),
        row(KvStore, Cache, Bf16, 0.0, 0.0, EXACT),
        row(KvStore, Cache, Model1Fp8, 0.0, 0.0, EXACT),
        row(IndexerLogits, Logits, Fp8E4m3, INDEXER_ATOL, 0.0, INDEXER),
        row(IndexerLogits, Logits, Bf16, INDEXER_ATOL, 0.0, INDEXER),
        row(IndexerLogits, Logits, Fp4E2m1, INDEXER_ATOL, 0.0, INDEXER),
        row(Topk, Indices, Fp32, 0.0, 0.0, EXACT),
        row(
            SparseMla,
            Out,
            Fp8DsMla,
            MLA_P_ROUNDING,
            BF16_UNIT_ROUNDOFF,
            MLA_OUT,
        ),
        row(
            SparseMla,
            Out,
            Bf16,
            MLA_P_ROUNDING,
            BF16_UNIT_ROUNDOFF,
            MLA_OUT,
        ),
        row(
            SparseMla,
            Quantity::Lse,
            Fp8DsMla,
            MLA_LSE_ATOL,
            1e-6,
            MLA_LSE,
        ),
        row(SparseMla, Quantity::Lse, Bf16, MLA_LSE_ATOL, 1e-6, MLA_LSE),
        row(
            SparseMlaV4,
            Out,
            Model1Fp8,
            MLA_P_ROUNDING,
            BF16_UNIT_ROUNDOFF,
            MLA_OUT,
        ),
        row(
            SparseMlaV4,
            Out,
            Bf16,
            MLA_P_ROUNDING,
            BF16_UNIT_ROUNDOFF,
            MLA_OUT,
        ),
        row(
            SparseMlaV4,
            Quantity::Lse,
            Model1Fp8,
            MLA_LSE_ATOL,
            1e-6,
            MLA_LSE,
        ),
        row(
            SparseMlaV4,
            Quantity::Lse,
            Bf16,
            MLA_LSE_ATOL,
            1e-6,
            MLA_LSE,
        ),
        row(CopyPages, Quantity::Pages, Bytes, 0.0, 0.0, EXACT),
        row(PageChecksums, Checksums, U64, 0.0, 0.0, EXACT),
    ]
};

const fn row(
    op: Op,
    quantity: Quantity,
    dtype: DataType,
    atol: f64,
    rtol: f64,
    basis: &'static str,
) -> Tolerance {
    Tolerance {
        op,
        quantity,
        dtype,
        atol,
        rtol,
        basis,
    }
}

/// The tolerance of `(op, quantity, dtype)`; a missing row is an error (a bug in the
/// table).
pub fn get(op: Op, quantity: Quantity, dtype: DataType) -> Result<&'static Tolerance, Error> {
    TABLE
        .iter()
        .find(|t| t.op == op && t.quantity == quantity && t.dtype == dtype)
        .ok_or_else(|| Error::InvalidArgument {
            what: "tolerance",
            detail: format!("no tolerance row for {}/{quantity}/{dtype}", op.name()),
        })
}

/// Running error statistics of one comparison.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ErrorStats {
    /// Elements compared (each element once, failing or not).
    pub count: usize,
    /// Elements outside tolerance (NaN and infinity mismatches included).
    pub failures: usize,
    /// Largest |got - ref| over finite pairs.
    pub max_abs_err: f64,
    /// Largest |got - ref| / |ref|: over every failing element (infinite when its ref is
    /// 0), and over passing ones with |ref| above 1e-3 of the largest |ref|.
    pub max_rel_err: f64,
    /// Largest `|got - ref| / allowed` (≤ 1 passes; infinite for a failing exact
    /// comparison or a NaN/infinity mismatch).
    pub worst_ratio: f64,
    /// First failing element: (index, got, ref).
    pub first_failure: Option<(usize, f64, f64)>,
    #[serde(skip)]
    ref_max: f64,
    /// (error, |ref|, failed) of the pairs that differ.
    #[serde(skip)]
    rel_pairs: Vec<(f64, f64, bool)>,
}

impl ErrorStats {
    /// Compares one element.
    pub fn add(&mut self, index: usize, got: f64, want: f64, magnitude: f64, t: &Tolerance) {
        self.count += 1;
        let ok = if want.is_nan() {
            false
        } else if want.is_infinite() || got.is_infinite() || got.is_nan() {
            got == want
        } else {
            let err = (got - want).abs();
            let allowed = t.atol * magnitude + t.rtol * want.abs();
            self.max_abs_err = self.max_abs_err.max(err);
            self.ref_max = self.ref_max.max(want.abs());
            if err > 0.0 {
                self.rel_pairs.push((err, want.abs(), err > allowed));
                let ratio = if allowed > 0.0 {
                    err / allowed
                } else {
                    f64::INFINITY
                };
                self.worst_ratio = self.worst_ratio.max(ratio);
            }
            err <= allowed
        };
        if !ok {
            self.failures += 1;
            if !(got - want).is_finite() {
                self.worst_ratio = f64::INFINITY;
            }
            self.first_failure.get_or_insert((index, got, want));
        }
    }

    /// Compares one element of a case with non-finite inputs: where the reference gives
    /// NaN the output must be NaN too; otherwise as [`ErrorStats::add`].
    pub fn add_nonfinite(
        &mut self,
        index: usize,
        got: f64,
        want: f64,
        magnitude: f64,
        t: &Tolerance,
    ) {
        if want.is_nan() {
            self.count += 1;
            if !got.is_nan() {
                self.failures += 1;
                self.worst_ratio = f64::INFINITY;
                self.first_failure.get_or_insert((index, got, want));
            }
        } else {
            self.add(index, got, want, magnitude, t);
        }
    }

    /// Records one compared element that failed outside an element comparison (a wrong
    /// index, a length mismatch): err/tol is infinite.
    pub fn fail(&mut self, index: usize, got: f64, want: f64) {
        self.count += 1;
        self.failures += 1;
        self.worst_ratio = f64::INFINITY;
        let err = (got - want).abs();
        if err.is_finite() {
            self.max_abs_err = self.max_abs_err.max(err);
        }
        self.first_failure.get_or_insert((index, got, want));
    }

    /// Finishes the relative-error figure.
    pub fn finish(&mut self) {
        let floor = 1e-3 * self.ref_max;
        self.max_rel_err = self
            .rel_pairs
            .iter()
            .filter(|(_, r, failed)| *failed || (*r > floor && *r > 0.0))
            .fold(self.max_rel_err, |m, (e, r, _)| {
                m.max(if *r > 0.0 { e / r } else { f64::INFINITY })
            });
        self.rel_pairs = Vec::new();
    }

    /// One line: failures of count, the first failure, the worst error/tolerance.
    pub fn summary(&self) -> String {
        let first = self.first_failure.map_or(String::new(), |(i, g, w)| {
            format!(", first at {i}: got {g}, expected {w}")
        });
        format!(
            "{} of {} elements out of tolerance{first}, worst err/tol {:.3}",
            self.failures, self.count, self.worst_ratio
        )
    }

    /// Whether every element passed (and at least one was compared).
    pub fn pass(&self) -> bool {
        self.failures == 0 && self.count > 0
    }

    /// Merges another comparison into this one.
    pub fn merge(&mut self, o: &ErrorStats) {
        self.count += o.count;
        self.failures += o.failures;
        self.max_abs_err = self.max_abs_err.max(o.max_abs_err);
        self.max_rel_err = self.max_rel_err.max(o.max_rel_err);
        self.worst_ratio = self.worst_ratio.max(o.worst_ratio);
        if self.first_failure.is_none() {
            self.first_failure = o.first_failure;
        }
    }
}

/// Byte-for-byte comparison: every byte is counted, each differing one a failure (a
/// length mismatch is one failure at index 0).
pub fn compare_bytes(stats: &mut ErrorStats, got: &[u8], want: &[u8]) {
    if got.len() != want.len() {
        stats.fail(0, got.len() as f64, want.len() as f64);
        return;
    }
    bitwise(stats, 0, got, want);
}

/// Bit-identity of two outputs: every byte counted, each differing one a failure (index
/// offset by `base`), a length mismatch a failure.
pub fn bitwise(stats: &mut ErrorStats, base: usize, got: &[u8], want: &[u8]) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if g == w {
            stats.count += 1;
        } else {
            stats.fail(base + i, *g as f64, *w as f64);
        }
    }
    if got.len() != want.len() {
        stats.fail(base, got.len() as f64, want.len() as f64);
    }
}

/// Judges one top-k row of `k = got.len()` entries (flat index of entry 0: `base`): the
/// entries must be exactly the tie rule's `want` (ascending positions, ties to the lower
/// position, `-1` padding), and the values they select (`got_vals`) the expected
/// selection's (`want_vals`, as a multiset). The row's `k` entries are counted once each;
/// the failures are the entries that differ from the rule, or, if more, the selected
/// values left unmatched by the expected ones. err/tol of a failure is infinite.
pub fn judge_topk_row(
    stats: &mut ErrorStats,
    base: usize,
    got: &[i32],
    want: &[i32],
    got_vals: &[f64],
    want_vals: &[f64],
) {
    let k = got.len();
    stats.count += k;
    let mut gv = got_vals.to_vec();
    let mut wv = want_vals.to_vec();
    gv.sort_by(f64::total_cmp);
    wv.sort_by(f64::total_cmp);
    // Multiset intersection of two sorted lists.
    let (mut i, mut j, mut matched) = (0, 0, 0);
    while i < gv.len() && j < wv.len() {
        match gv[i].total_cmp(&wv[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                matched += 1;
                i += 1;
                j += 1;
            }
        }
    }
    let unmatched = (gv.len() - matched).max(wv.len() - matched);
    let wrong: Vec<usize> = (0..k.min(want.len()))
        .filter(|&e| got[e] != want[e])
        .collect();
    let fails = wrong.len().max(unmatched).min(k.max(1));
    if fails == 0 {
        return;
    }
    stats.failures += fails;
    stats.worst_ratio = f64::INFINITY;
    for (g, w) in gv.iter().zip(&wv) {
        let e = (g - w).abs();
        if e.is_finite() {
            stats.max_abs_err = stats.max_abs_err.max(e);
        }
    }
    let first = match wrong.first() {
        Some(&e) => (base + e, got[e] as f64, want[e] as f64),
        None => {
            let at = gv.iter().zip(&wv).position(|(g, w)| g != w);
            let (g, w) = at.map_or((gv.len() as f64, wv.len() as f64), |a| (gv[a], wv[a]));
            (base, g, w)
        }
    };
    stats.first_failure.get_or_insert(first);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nan_never_passes_and_infinities_must_match() {
        let t = get(Op::IndexerLogits, Quantity::Logits, DataType::Bf16).unwrap();
        let mut s = ErrorStats::default();
        s.add(0, f64::NAN, 1.0, 1.0, t);
        assert!(!s.pass());
        let mut s = ErrorStats::default();
        s.add(0, f64::NEG_INFINITY, f64::NEG_INFINITY, 0.0, t);
        s.add(1, 1.0, 1.0, 1.0, t);
        assert!(s.pass());
        s.add(2, 5.0, f64::NEG_INFINITY, 0.0, t);
        assert!(!s.pass());
        let mut s = ErrorStats::default();
        s.add(0, 1.0 + 1e-6, 1.0, 1.0, t);
        assert!(s.pass());
        s.add(1, 1.0 + 1e-4, 1.0, 1.0, t);
        assert!(!s.pass());
        assert!(
            !ErrorStats::default().pass(),
            "an empty comparison is not a pass"
        );
    }

    /// Term 1 of the sparse MLA bound, checked on simulated kernels (weights rounded to
    /// bf16, normalised by their rounded sum): never exceeded on random weights and
    /// values, and reached to more than 40% by the cancellation construction.
    #[test]
    fn p_rounding_bound_holds_and_is_not_vacuous() {
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let round = |p: f64| half::bf16::from_f64(p).to_f64();
        let worst = |p: &[f64], v: &[f64]| {
            let (s, st): (f64, f64) = (p.iter().sum(), p.iter().map(|&x| round(x)).sum());
            let o: f64 = p.iter().zip(v).map(|(p, v)| p * v).sum::<f64>() / s;
            let ot: f64 = p.iter().zip(v).map(|(p, v)| round(*p) * v).sum::<f64>() / st;
            let a: f64 = p.iter().zip(v).map(|(p, v)| p * v.abs()).sum::<f64>() / s;
            (ot - o).abs() / (MLA_P_ROUNDING * a)
        };
        for _ in 0..2000 {
            let n = rng.gen_range(1..300);
            let mut p: Vec<f64> = (0..n)
                .map(|_| (-rng.gen_range(0.0..20.0f64)).exp())
                .collect();
            p[0] = 1.0;
            let v: Vec<f64> = (0..n).map(|_| rng.gen_range(-4.0..4.0)).collect();
            let r = worst(&p, &v);
            assert!(r <= 1.0, "ratio {r} (seed {seed})");
        }
        // Weights just past rounding midpoints, against values of opposite signs.
        let (down, up) = (
            (1.0 + 1.0 / 256.0 - 1.0 / 4096.0) / 2.0,
            (1.0 + 3.0 / 256.0 + 1.0 / 4096.0) / 2.0,
        );
        let mut p = vec![1.0];
        let mut v = vec![0.0];
        for j in 0..200 {
            p.push(if j % 2 == 0 { down } else { up });
            v.push(if j % 2 == 0 { 1.0 } else { -1.0 });
        }
        let r = worst(&p, &v);
        assert!(r > 0.4 && r <= 1.0, "cancellation ratio {r}");
        // The magnitude adds the other terms on top of A.
        assert!(mla_out_magnitude(1.0, 10.0, 2048, 1.0) > 1.0);
        // With nothing to add but the bf16 dot product's flushes: (n + 1) · 2^-126.
        let flushes = mla_out_magnitude(0.0, 10.0, 2048, 0.0) * MLA_P_ROUNDING;
        assert!(
            (flushes / (2049.0 * DOT_FLUSH) - 1.0).abs() < 1e-12,
            "{flushes}"
        );
        assert_eq!(dot_flush_magnitude(4, 0.5), 8.0 * DOT_FLUSH);
    }

    #[test]
    fn every_op_has_a_row_and_rows_are_unique() {
        for op in Op::ALL {
            assert!(TABLE.iter().any(|t| t.op == op), "{}", op.name());
        }
        for (i, a) in TABLE.iter().enumerate() {
            for b in &TABLE[i + 1..] {
                assert!(
                    (a.op, a.quantity, a.dtype) != (b.op, b.quantity, b.dtype),
                    "duplicate row {a:?}"
                );
            }
        }
        assert!(get(Op::Topk, Quantity::Indices, DataType::Bf16).is_err());
    }

    #[test]
    fn judges_fail_on_any_difference() {
        let mut s = ErrorStats::default();
        bitwise(&mut s, 0, &[1, 2, 3], &[1, 2, 3]);
        assert!(s.pass());
        bitwise(&mut s, 0, &[1, 2, 4], &[1, 2, 3]);
        assert!(!s.pass());
        let mut s = ErrorStats::default();
        compare_bytes(&mut s, &[0; 4], &[0; 5]);
        assert_eq!(s.failures, 1);
        let mut s = ErrorStats::default();
        compare_bytes(&mut s, &[1, 2, 3, 4], &[1, 9, 3, 8]);
        assert_eq!((s.count, s.failures), (4, 2), "every byte counted once");
        assert_eq!(s.worst_ratio, f64::INFINITY);
        let mut s = ErrorStats::default();
        judge_topk_row(
            &mut s,
            0,
            &[1, 3, -1],
            &[1, 3, -1],
            &[2.0, 1.0],
            &[1.0, 2.0],
        );
        assert!(s.pass());
        judge_topk_row(
            &mut s,
            3,
            &[1, 4, -1],
            &[1, 3, -1],
            &[2.0, 1.0],
            &[1.0, 2.0],
        );
        assert!(!s.pass(), "a tie broken the wrong way fails");
        assert_eq!((s.count, s.failures), (6, 1));
        assert_eq!(s.first_failure, Some((4, 4.0, 3.0)));
        assert_eq!(s.worst_ratio, f64::INFINITY);
        // One expected entry with another value, in a long row: one failure, not one per
        // shifted position of the sorted values.
        let mut s = ErrorStats::default();
        let vals: Vec<f64> = (0..64).map(|v| v as f64).collect();
        let mut other = vals.clone();
        other[0] = -5.0;
        let pos: Vec<i32> = (0..64).collect();
        judge_topk_row(&mut s, 0, &pos, &pos, &vals, &other);
        assert_eq!((s.count, s.failures), (64, 1));
    }

    #[test]
    fn relative_error_includes_every_failing_element() {
        let t = get(Op::IndexerLogits, Quantity::Logits, DataType::Bf16).unwrap();
        let mut s = ErrorStats::default();
        s.add(0, 1000.0, 1000.0, 1.0, t);
        // A failing element far below 1e-3 of the largest |ref|: relative error 7.
        s.add(1, 0.008, 0.001, 1e-9, t);
        s.finish();
        assert_eq!(s.failures, 1);
        assert!((s.max_rel_err - 7.0).abs() < 1e-9, "{}", s.max_rel_err);
        let mut s = ErrorStats::default();
        s.add(0, 1e-3, 0.0, 0.0, t);
        s.finish();
        assert_eq!(s.max_rel_err, f64::INFINITY);
    }
}
