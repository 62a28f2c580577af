//! The tolerance table (one place for every op × dtype) and the error statistics that
//! judge an output against its reference.
//!
//! An element passes when `|got - ref| <= atol · magnitude + rtol · |ref|`, where
//! `magnitude` is a per-element error scale computed by the reference (documented per row
//! in [`Tolerance::basis`]). NaN in an output never passes; infinities must match exactly.

use serde::Serialize;

/// Allowed error of one quantity of one op for one dtype.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Tolerance {
    /// Op name (`Op::name`).
    pub op: &'static str,
    /// Output compared (`cache`, `logits`, `indices`, `out`, `lse`).
    pub quantity: &'static str,
    /// Cache dtype of the case (`fp8_e4m3`, `bf16`, `fp8_ds_mla`).
    pub dtype: &'static str,
    /// Multiplies the reference's per-element magnitude.
    pub atol: f64,
    /// Multiplies |ref|.
    pub rtol: f64,
    /// What the magnitude is.
    pub basis: &'static str,
}

const EXACT: &str = "exact: bytes / indices must be identical";
const INDEXER: &str = "magnitude = Σ_h |w_h|·Σ_d |q_hd·k_d|·scale (f32 dot of 128 + head sum)";
const MLA_OUT: &str = "magnitude = max |v| over the token's slots; rtol = bf16 rounding (2^-8)";
const MLA_LSE: &str = "magnitude = softmax_scale · max_j Σ_d |q_d·k_jd|";

/// Every tolerance, in one table.
pub const TABLE: &[Tolerance] = &[
    tol("index_k_store", "cache", "fp8_e4m3", 0.0, 0.0, EXACT),
    tol("index_k_store", "cache", "bf16", 0.0, 0.0, EXACT),
    tol("kv_store", "cache", "fp8_ds_mla", 0.0, 0.0, EXACT),
    tol("kv_store", "cache", "bf16", 0.0, 0.0, EXACT),
    tol("indexer_logits", "logits", "fp8_e4m3", 2e-5, 0.0, INDEXER),
    tol("indexer_logits", "logits", "bf16", 2e-5, 0.0, INDEXER),
    tol("topk", "indices", "fp32", 0.0, 0.0, EXACT),
    tol(
        "sparse_mla",
        "out",
        "fp8_ds_mla",
        1e-3,
        1.0 / 256.0,
        MLA_OUT,
    ),
    tol("sparse_mla", "out", "bf16", 1e-3, 1.0 / 256.0, MLA_OUT),
    tol("sparse_mla", "lse", "fp8_ds_mla", 2e-5, 1e-6, MLA_LSE),
    tol("sparse_mla", "lse", "bf16", 2e-5, 1e-6, MLA_LSE),
    tol("copy_pages", "pages", "bytes", 0.0, 0.0, EXACT),
    tol("page_checksums", "checksums", "u64", 0.0, 0.0, EXACT),
];

const fn tol(
    op: &'static str,
    quantity: &'static str,
    dtype: &'static str,
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

/// Looks up the tolerance of `(op, quantity, dtype)`.
pub fn lookup(op: &str, quantity: &str, dtype: &str) -> Option<&'static Tolerance> {
    TABLE
        .iter()
        .find(|t| t.op == op && t.quantity == quantity && t.dtype == dtype)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nan_never_passes_and_infinities_must_match() {
        let t = lookup("indexer_logits", "logits", "bf16")
            .copied()
            .unwrap_or(TABLE[4]);
        let mut s = ErrorStats::default();
        s.add(0, f64::NAN, 1.0, 1.0, &t);
        assert!(!s.pass());
        let mut s = ErrorStats::default();
        s.add(0, f64::NEG_INFINITY, f64::NEG_INFINITY, 0.0, &t);
        s.add(1, 1.0, 1.0, 1.0, &t);
        assert!(s.pass());
        s.add(2, 5.0, f64::NEG_INFINITY, 0.0, &t);
        assert!(!s.pass());
        let mut s = ErrorStats::default();
        s.add(0, 1.0 + 1e-6, 1.0, 1.0, &t);
        assert!(s.pass());
        s.add(1, 1.0 + 1e-4, 1.0, 1.0, &t);
        assert!(!s.pass());
        assert!(
            !ErrorStats::default().pass(),
            "an empty comparison is not a pass"
        );
    }

    #[test]
    fn every_op_has_a_row() {
        for op in sparsekit_host::ops::Op::ALL {
            assert!(TABLE.iter().any(|t| t.op == op.name()), "{}", op.name());
        }
    }
}
