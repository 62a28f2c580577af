//! The tolerance table (one place for every op × quantity × dtype, keyed by enums), the
//! error statistics that judge an output against its reference, and the judges shared by
//! the suite and the golden-file checks.
//!
//! An element passes when `|got - ref| <= atol · magnitude + rtol · |ref|`, where
//! `magnitude` is a per-element error scale computed by the reference (documented per row
//! in [`Tolerance::basis`]). NaN in an output never passes; infinities must match exactly.

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
        }
    }
}

impl From<KvDtype> for DataType {
    fn from(d: KvDtype) -> Self {
        match d {
            KvDtype::Bf16 => DataType::Bf16,
            KvDtype::Fp8DsMla => DataType::Fp8DsMla,
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
const INDEXER: &str = "magnitude = Σ_h |w_h|·Σ_d |q_hd·k_d|·scale (f32 dot of 128 + head sum)";
const MLA_OUT: &str = "magnitude = max |v| over the token's slots; rtol = bf16 rounding (2^-8)";
const MLA_LSE: &str = "magnitude = softmax_scale · max_j Σ_d |q_d·k_jd|";

/// Every tolerance, in one table.
pub const TABLE: &[Tolerance] = {
    use DataType::*;
    use Op::*;
    use Quantity::{Cache, Checksums, Indices, Logits, Out};
    &[
        row(IndexKStore, Cache, Fp8E4m3, 0.0, 0.0, EXACT),
        row(IndexKStore, Cache, Bf16, 0.0, 0.0, EXACT),
        row(KvStore, Cache, Fp8DsMla, 0.0, 0.0, EXACT),
        row(KvStore, Cache, Bf16, 0.0, 0.0, EXACT),
        row(IndexerLogits, Logits, Fp8E4m3, 2e-5, 0.0, INDEXER),
        row(IndexerLogits, Logits, Bf16, 2e-5, 0.0, INDEXER),
        row(Topk, Indices, Fp32, 0.0, 0.0, EXACT),
        row(SparseMla, Out, Fp8DsMla, 1e-3, 1.0 / 256.0, MLA_OUT),
        row(SparseMla, Out, Bf16, 1e-3, 1.0 / 256.0, MLA_OUT),
        row(SparseMla, Quantity::Lse, Fp8DsMla, 2e-5, 1e-6, MLA_LSE),
        row(SparseMla, Quantity::Lse, Bf16, 2e-5, 1e-6, MLA_LSE),
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
    /// Elements compared.
    pub count: usize,
    /// Elements outside tolerance (NaN and infinity mismatches included).
    pub failures: usize,
    /// Largest |got - ref| over finite pairs.
    pub max_abs_err: f64,
    /// Largest |got - ref| / |ref| over pairs with |ref| above 1e-3 of the largest |ref|.
    pub max_rel_err: f64,
    /// Largest `|got - ref| / allowed` (≤ 1 passes).
    pub worst_ratio: f64,
    /// First failing element: (index, got, ref).
    pub first_failure: Option<(usize, f64, f64)>,
    #[serde(skip)]
    ref_max: f64,
    #[serde(skip)]
    rel_pairs: Vec<(f64, f64)>,
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
                self.rel_pairs.push((err, want.abs()));
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

    /// Records a failure that is not an element comparison (a wrong index, say).
    pub fn fail(&mut self, index: usize, got: f64, want: f64) {
        self.count += 1;
        self.failures += 1;
        self.max_abs_err = self.max_abs_err.max((got - want).abs());
        self.first_failure.get_or_insert((index, got, want));
    }

    /// Finishes the relative-error figure.
    pub fn finish(&mut self) {
        let floor = 1e-3 * self.ref_max;
        self.max_rel_err = self
            .rel_pairs
            .iter()
            .filter(|(_, r)| *r > floor && *r > 0.0)
            .fold(0.0, |m, (e, r)| m.max(e / r));
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

/// Byte-for-byte comparison: every differing byte is a failure (a length mismatch fails
/// at index 0); equal bytes are not counted.
pub fn compare_bytes(stats: &mut ErrorStats, got: &[u8], want: &[u8]) {
    if got.len() != want.len() {
        stats.fail(0, got.len() as f64, want.len() as f64);
        return;
    }
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        let n = got.iter().zip(want).filter(|(a, b)| a != b).count();
        for _ in 0..n {
            stats.fail(i, got[i] as f64, want[i] as f64);
        }
    }
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

/// Judges one top-k row: exact positions (ties to the lower position), ascending order,
/// `-1` padding; the value multisets of the selections are compared too (a failure there
/// names the wrong value).
pub fn judge_topk_row(
    stats: &mut ErrorStats,
    base: usize,
    got: &[i32],
    want: &[i32],
    got_vals: &[f64],
    want_vals: &[f64],
) {
    let mut gv = got_vals.to_vec();
    let mut wv = want_vals.to_vec();
    gv.sort_by(f64::total_cmp);
    wv.sort_by(f64::total_cmp);
    if gv.len() != wv.len() {
        stats.fail(base, gv.len() as f64, wv.len() as f64);
    } else {
        for (i, (g, w)) in gv.iter().zip(&wv).enumerate() {
            if g != w {
                stats.fail(base + i, *g, *w);
            }
        }
    }
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if g != w {
            stats.fail(base + i, *g as f64, *w as f64);
        } else {
            stats.count += 1;
        }
    }
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
            0,
            &[1, 4, -1],
            &[1, 3, -1],
            &[2.0, 1.0],
            &[1.0, 2.0],
        );
        assert!(!s.pass(), "a tie broken the wrong way fails");
    }
}
