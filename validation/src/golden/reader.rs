//! Reading one op's tensors and params out of a golden file, with typed errors for every
//! way a file can be malformed.

use std::collections::BTreeSet;

use serde::de::DeserializeOwned;
use serde_json::Value;
use sparsekit_host::ops::{decode_rows, Op, QueryRange};

use super::conventions::Conventions;
use super::{Dtype, Golden, GoldenError, Result, Tensor, VERSION};

/// Largest value accepted for a size parameter (keeps every size product in range).
const MAX_PARAM: usize = 1 << 24;

/// Reads the tensors of one file for one op, remembering which were used.
pub(super) struct Reader<'g> {
    g: &'g Golden,
    op: Op,
    used: BTreeSet<&'static str>,
}

/// A dimension of an expected shape: its name and, when fixed, its size.
type Dim = (&'static str, Option<usize>);

impl<'g> Reader<'g> {
    /// A reader of `g`'s tensors for `op`.
    pub(super) fn new(g: &'g Golden, op: Op) -> Self {
        Reader {
            g,
            op,
            used: BTreeSet::new(),
        }
    }

    /// Whether the file holds a tensor `name` (read or not).
    pub(super) fn holds(&self, name: &str) -> bool {
        self.g.tensors.contains_key(name)
    }

    /// Whether the tensor `name` was read.
    pub(super) fn used(&self, name: &str) -> bool {
        self.used.contains(name)
    }

    /// A bad-params error for this op.
    pub(super) fn bad(&self, detail: impl Into<String>) -> GoldenError {
        GoldenError::BadParams {
            op: self.op.name().into(),
            detail: detail.into(),
        }
    }

    pub(super) fn params<P: DeserializeOwned>(&self) -> Result<P> {
        match self.g.params.get("version").map(Value::as_u64) {
            Some(Some(v)) if v == VERSION as u64 => {}
            Some(_) => {
                return Err(self.bad(format!(
                    "version {} is not supported (this build reads version {VERSION})",
                    self.g.params["version"]
                )))
            }
            None => return Err(self.bad(format!("version is missing (use {VERSION})"))),
        }
        serde_json::from_value(self.g.params.clone()).map_err(|e| self.bad(e.to_string()))
    }

    /// Checks that every convention the file states applies to this op.
    pub(super) fn conventions(&self, c: &Conventions) -> Result<()> {
        c.check_applies(self.op).map_err(|e| self.bad(e))
    }

    /// Checks that size parameters are in `1..=2^24`.
    pub(super) fn sizes(&self, sizes: &[(&str, usize)]) -> Result<()> {
        match sizes.iter().find(|(_, v)| *v == 0 || *v > MAX_PARAM) {
            Some((name, v)) => Err(self.bad(format!("{name} = {v} must be in 1..={MAX_PARAM}"))),
            None => Ok(()),
        }
    }

    fn has(&self, name: &str) -> bool {
        self.g.tensors.contains_key(name)
    }

    /// The tensor `name`, checked against `dtype` and `dims`.
    pub(super) fn tensor(
        &mut self,
        name: &'static str,
        dtype: Dtype,
        dims: &[Dim],
    ) -> Result<&'g Tensor> {
        self.tensor_of(name, &[dtype], dims, false)
    }

    /// The tensor `name` with one of `dtypes` and `dims`, or, with `lead`, any number of
    /// leading dimensions before `dims[1..]` whose product is `dims[0]` (e.g. FlashMLA's
    /// `[batch, s_q, h, d]` for our `[n_tokens, h, d]`).
    pub(super) fn tensor_of(
        &mut self,
        name: &'static str,
        dtypes: &[Dtype],
        dims: &[Dim],
        lead: bool,
    ) -> Result<&'g Tensor> {
        self.used.insert(name);
        let t = self.g.tensors.get(name).ok_or(GoldenError::MissingTensor {
            op: self.op.name(),
            name: name.to_string(),
        })?;
        if !dtypes.contains(&t.dtype) {
            return Err(GoldenError::WrongDtype {
                name: name.into(),
                expected: dtypes[0],
                actual: t.dtype,
            });
        }
        let fits_dims = |shape: &[usize]| {
            shape.len() == dims.len()
                && shape
                    .iter()
                    .zip(dims)
                    .all(|(s, (_, d))| d.is_none_or(|d| d == *s))
        };
        let fits = fits_dims(&t.shape)
            || (lead && t.shape.len() > dims.len() && {
                let k = t.shape.len() + 1 - dims.len();
                let leading = t.shape[..k]
                    .iter()
                    .try_fold(1usize, |a, &s| a.checked_mul(s));
                let mut flat = vec![leading.unwrap_or(usize::MAX)];
                flat.extend_from_slice(&t.shape[k..]);
                leading.is_some() && fits_dims(&flat)
            });
        let elems = t.shape.iter().try_fold(1usize, |a, &s| a.checked_mul(s));
        if !fits || elems.and_then(|n| n.checked_mul(t.dtype.size())) != Some(t.data.len()) {
            let mut expected: Vec<String> = dims
                .iter()
                .map(|(n, d)| d.map_or(n.to_string(), |d| format!("{n}={d}")))
                .collect();
            if lead {
                expected[0] = format!("{} (or leading dims of that product)", expected[0]);
            }
            return Err(GoldenError::WrongShape {
                name: name.into(),
                expected: format!("[{}]", expected.join(", ")),
                actual: t.shape.clone(),
            });
        }
        Ok(t)
    }

    /// The product of a tensor's leading dimensions (all but the last `trailing`).
    pub(super) fn leading(t: &Tensor, trailing: usize) -> usize {
        t.shape[..t.shape.len().saturating_sub(trailing)]
            .iter()
            .product()
    }

    /// A paged cache: U8 `[num_pages, bytes_per_page]`.
    pub(super) fn cache(
        &mut self,
        name: &'static str,
        bytes_per_page: usize,
        pages: Option<usize>,
    ) -> Result<&'g Tensor> {
        self.tensor(
            name,
            Dtype::U8,
            &[
                ("num_pages", pages),
                ("bytes_per_page", Some(bytes_per_page)),
            ],
        )
    }

    /// The query rows of a batch of `n_rows`: `rows` I32 `[n_rows, 3]` (request, start,
    /// end) or `context_lens` I32 `[n_requests]` with `params.next_n`. Returns the rows
    /// and, for the decode form, the number of requests.
    pub(super) fn rows(
        &mut self,
        n_rows: usize,
        next_n: Option<usize>,
    ) -> Result<(Vec<QueryRange>, Option<usize>)> {
        let non_neg = |what: &str, v: i32| {
            u32::try_from(v).map_err(|_| GoldenError::Invalid(format!("{what} = {v} is negative")))
        };
        match (self.has("rows"), self.has("context_lens"), next_n) {
            (true, true, _) => Err(self.bad("give rows or context_lens, not both")),
            (true, false, Some(_)) => {
                Err(self.bad("next_n applies to the decode form (context_lens) only"))
            }
            (false, true, None) => Err(self.bad("next_n is required with context_lens")),
            (true, false, None) => {
                let t = self.tensor(
                    "rows",
                    Dtype::I32,
                    &[("n_rows", Some(n_rows)), ("3", Some(3))],
                )?;
                let rows = t
                    .values::<i32>()
                    .chunks(3)
                    .enumerate()
                    .map(|(i, c)| {
                        Ok(QueryRange {
                            request: non_neg(&format!("rows[{i}][0]"), c[0])?,
                            start: non_neg(&format!("rows[{i}][1]"), c[1])?,
                            end: non_neg(&format!("rows[{i}][2]"), c[2])?,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok((rows, None))
            }
            (false, true, Some(next_n)) => {
                self.sizes(&[("next_n", next_n)])?;
                let t = self.tensor("context_lens", Dtype::I32, &[("n_requests", None)])?;
                let lens = t
                    .values::<i32>()
                    .iter()
                    .enumerate()
                    .map(|(i, &v)| non_neg(&format!("context_lens[{i}]"), v))
                    .collect::<Result<Vec<u32>>>()?;
                if lens.len().checked_mul(next_n) != Some(n_rows) {
                    return Err(GoldenError::Invalid(format!(
                        "{} requests × next_n {next_n} rows, but the batch has {n_rows} rows",
                        lens.len()
                    )));
                }
                let rows = decode_rows(&lens, next_n).map_err(GoldenError::Rejected)?;
                Ok((rows, Some(lens.len())))
            }
            (false, false, _) => Err(GoldenError::MissingTensor {
                op: self.op.name(),
                name: "rows (or context_lens)".into(),
            }),
        }
    }

    /// The page table: I32 `[n_requests, max_pages]`.
    pub(super) fn page_table(&mut self, n_requests: Option<usize>) -> Result<(Vec<i32>, usize)> {
        let t = self.tensor(
            "page_table",
            Dtype::I32,
            &[("n_requests", n_requests), ("max_pages", None)],
        )?;
        Ok((t.values(), t.shape[1]))
    }
}
