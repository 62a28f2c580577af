//! The file format: tensors, reading and writing safetensors files, and the constructors
//! that write one op's file from the f64 references.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use bytemuck::Pod;
use half::bf16;
use safetensors::{SafeTensorError, SafeTensors, View};
use serde::Serialize;
use serde_json::Value;
use sparsekit_host::ops::{
    decode_rows, IndexKStore, IndexerLogits, KvStore, Op, PageTable, QueryRange, ShortRows,
    SparseMla, Topk, TopkOutput,
};

use super::judge::topk_want;
use super::params::{
    index_dt, kv_dt, IndexKStoreParams, IndexerLogitsParams, KvStoreParams, ShortRowsP,
    SparseMlaParams, TopkOut, TopkParams,
};
use super::{Decode, Dtype, ExpectedFrom, Golden, GoldenError, Result, VERSION};
use crate::reference;

/// One tensor of a golden file: little-endian, row-major bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct Tensor {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tensor({:?} {:?}, {} bytes)",
            self.dtype,
            self.shape,
            self.data.len()
        )
    }
}

impl Tensor {
    /// A tensor holding `values` (whose length must match `shape`).
    pub fn new<T: Pod>(dtype: Dtype, shape: &[usize], values: &[T]) -> Tensor {
        Tensor {
            dtype,
            shape: shape.to_vec(),
            data: bytemuck::cast_slice(values).to_vec(),
        }
    }

    /// The elements as `T` (copied: file data need not be aligned).
    pub fn values<T: Pod>(&self) -> Vec<T> {
        bytemuck::pod_collect_to_vec(&self.data)
    }
}

impl View for &Tensor {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        (&self.data[..]).into()
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

impl Golden {
    /// Parses a golden file's bytes (any op name is accepted here; [`Golden::check`]
    /// rejects unknown ones).
    pub fn from_bytes(bytes: &[u8]) -> Result<Golden> {
        let st_err = |e: SafeTensorError| {
            let hint = match e {
                SafeTensorError::InvalidHeaderDeserialization => {
                    " (__metadata__ values must be strings: params is a JSON string)"
                }
                _ => "",
            };
            GoldenError::Safetensors(format!("{e}{hint}"))
        };
        let (_, header) = SafeTensors::read_metadata(bytes).map_err(st_err)?;
        let st = SafeTensors::deserialize(bytes).map_err(st_err)?;
        let mut metadata: BTreeMap<String, String> = header
            .metadata()
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect();
        let op = metadata
            .remove("op")
            .ok_or(GoldenError::MissingMetadata("op"))?;
        let params = metadata
            .remove("params")
            .ok_or(GoldenError::MissingMetadata("params"))?;
        let params: Value = serde_json::from_str(&params).map_err(|e| GoldenError::BadParams {
            op: op.clone(),
            detail: format!("params is not JSON: {e}"),
        })?;
        let tensors = st
            .tensors()
            .into_iter()
            .map(|(name, v)| {
                let t = Tensor {
                    dtype: v.dtype(),
                    shape: v.shape().to_vec(),
                    data: v.data().to_vec(),
                };
                (name, t)
            })
            .collect();
        Ok(Golden {
            op,
            params,
            metadata,
            tensors,
        })
    }

    /// Reads a golden file.
    pub fn read_file(path: impl AsRef<Path>) -> Result<Golden> {
        Golden::from_bytes(&std::fs::read(path)?)
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut meta: HashMap<String, String> = self.metadata.clone().into_iter().collect();
        meta.insert("op".into(), self.op.clone());
        meta.insert("params".into(), self.params.to_string());
        safetensors::serialize(self.tensors.iter(), &Some(meta))
            .map_err(|e| GoldenError::Safetensors(e.to_string()))
    }

    /// Writes the file.
    pub fn write_file(&self, path: impl AsRef<Path>) -> Result<()> {
        Ok(std::fs::write(path, self.to_bytes()?)?)
    }

    fn set_params(&mut self, op: Op, params: &impl Serialize) -> Result<()> {
        self.op = op.name().to_string();
        self.params =
            serde_json::to_value(params).map_err(|e| GoldenError::Invalid(e.to_string()))?;
        Ok(())
    }

    fn put<T: Pod>(&mut self, name: &str, dtype: Dtype, shape: &[usize], values: &[T]) {
        self.tensors
            .insert(name.to_string(), Tensor::new(dtype, shape, values));
    }

    /// The tensors of a query-row batch: `rows` `[n, 3]`, or `context_lens` for the decode
    /// form (which must produce exactly `rows`). Returns `next_n` for the params.
    fn put_rows(
        &mut self,
        rows: &[QueryRange],
        decode: Option<Decode<'_>>,
    ) -> Result<Option<usize>> {
        let i32_of = |what: &str, v: u32| {
            i32::try_from(v).map_err(|_| GoldenError::Invalid(format!("{what} {v} exceeds i32")))
        };
        match decode {
            Some(d) => {
                if decode_rows(d.context_lens, d.next_n).map_err(GoldenError::Rejected)? != rows {
                    return Err(GoldenError::Invalid(
                        "the decode form does not produce the op's rows".into(),
                    ));
                }
                let lens = d
                    .context_lens
                    .iter()
                    .map(|&l| i32_of("context length", l))
                    .collect::<Result<Vec<i32>>>()?;
                self.put("context_lens", Dtype::I32, &[lens.len()], &lens);
                Ok(Some(d.next_n))
            }
            None => {
                let mut flat = Vec::with_capacity(rows.len() * 3);
                for r in rows {
                    for v in [r.request, r.start, r.end] {
                        flat.push(i32_of("row value", v)?);
                    }
                }
                self.put("rows", Dtype::I32, &[rows.len(), 3], &flat);
                Ok(None)
            }
        }
    }

    fn put_page_table(&mut self, pt: &PageTable<'_>) {
        self.put(
            "page_table",
            Dtype::I32,
            &[pt.num_requests(), pt.max_pages()],
            pt.as_slice(),
        );
    }

    /// An `index_k_store` file: inputs `keys` (bf16 `[n, head_dim]`), the op's slots and
    /// `cache_in` (whole pages); `cache_out` from [`reference::index_k_store`].
    pub fn index_k_store(op: &IndexKStore<'_>, keys: &[bf16], cache_in: &[u8]) -> Result<Golden> {
        let l = op.layout;
        let pages = op
            .validate(std::mem::size_of_val(keys), cache_in.len())
            .map_err(GoldenError::Rejected)?;
        let (dtype, scale) = index_dt(l.dtype());
        let p = IndexKStoreParams {
            version: VERSION,
            dtype,
            scale,
            head_dim: l.head_dim(),
            page_size: l.page_size(),
            conventions: Default::default(),
        };
        let mut g = Golden::default();
        g.set_params(Op::IndexKStore, &p)?;
        let mut out = cache_in.to_vec();
        reference::index_k_store(&l, &mut out, keys, op.slots);
        let cache_shape = [pages, l.bytes_per_page()];
        g.put("keys", Dtype::BF16, &[op.slots.len(), l.head_dim()], keys);
        g.put("slots", Dtype::I64, &[op.slots.len()], op.slots);
        g.put("cache_in", Dtype::U8, &cache_shape, cache_in);
        g.put("cache_out", Dtype::U8, &cache_shape, &out);
        Ok(g)
    }

    /// A `kv_store` file: inputs `kv` (bf16 `[n, nope_dim + rope_dim]`), the op's slots and
    /// `cache_in`; `cache_out` from [`reference::kv_store`].
    pub fn kv_store(op: &KvStore<'_>, kv: &[bf16], cache_in: &[u8]) -> Result<Golden> {
        let l = op.layout;
        let pages = op
            .validate(std::mem::size_of_val(kv), cache_in.len())
            .map_err(GoldenError::Rejected)?;
        let p = KvStoreParams {
            version: VERSION,
            dtype: kv_dt(l.dtype()),
            nope_dim: l.nope_dim(),
            rope_dim: l.rope_dim(),
            page_size: l.page_size(),
            conventions: Default::default(),
        };
        let mut g = Golden::default();
        g.set_params(Op::KvStore, &p)?;
        let mut out = cache_in.to_vec();
        reference::kv_store(&l, &mut out, kv, op.slots);
        let cache_shape = [pages, l.bytes_per_page()];
        g.put("kv", Dtype::BF16, &[op.slots.len(), l.d_qk()], kv);
        g.put("slots", Dtype::I64, &[op.slots.len()], op.slots);
        g.put("cache_in", Dtype::U8, &cache_shape, cache_in);
        g.put("cache_out", Dtype::U8, &cache_shape, &out);
        Ok(g)
    }

    /// An `indexer_logits` file; `logits` from [`reference::indexer_logits`] rounded to
    /// f32. With `decode`, the rows are written in the decode form.
    pub fn indexer_logits(
        op: &IndexerLogits<'_>,
        decode: Option<Decode<'_>>,
        q: &[bf16],
        weights: &[f32],
        cache: &[u8],
    ) -> Result<Golden> {
        let l = op.layout;
        let (n, h, stride) = (op.rows.len(), op.n_heads, op.row_stride);
        let pages = op
            .validate(
                std::mem::size_of_val(q),
                std::mem::size_of_val(weights),
                cache.len(),
                n * stride * 4,
            )
            .map_err(GoldenError::Rejected)?;
        let (dtype, scale) = index_dt(l.dtype());
        let mut g = Golden::default();
        let next_n = g.put_rows(&op.rows, decode)?;
        let p = IndexerLogitsParams {
            version: VERSION,
            dtype,
            scale,
            head_dim: l.head_dim(),
            page_size: l.page_size(),
            n_heads: h,
            row_stride: stride,
            next_n,
            expected_from: ExpectedFrom::Reference,
            conventions: Default::default(),
        };
        let want =
            reference::indexer_logits(&l, cache, &op.page_table, &op.rows, h, q, weights, stride);
        let logits: Vec<f32> = want.logits.iter().map(|&x| x as f32).collect();
        g.set_params(Op::IndexerLogits, &p)?;
        g.put_page_table(&op.page_table);
        g.put("q", Dtype::BF16, &[n, h, l.head_dim()], q);
        g.put("weights", Dtype::F32, &[n, h], weights);
        g.put("cache", Dtype::U8, &[pages, l.bytes_per_page()], cache);
        g.put("logits", Dtype::F32, &[n, stride], &logits);
        Ok(g)
    }

    /// A `topk` file; `topk` from [`reference::topk_row`] (ties to the lower position),
    /// as positions or slots per the op's output.
    pub fn topk(op: &Topk<'_>, decode: Option<Decode<'_>>, logits: &[f32]) -> Result<Golden> {
        let (n, k, stride) = (op.rows.len(), op.k, op.row_stride);
        op.validate(std::mem::size_of_val(logits), n * k * 4)
            .map_err(GoldenError::Rejected)?;
        let mut g = Golden::default();
        let next_n = g.put_rows(op.rows, decode)?;
        let (output, page_size) = match op.output {
            TopkOutput::Positions => (TopkOut::Positions, None),
            TopkOutput::Slots {
                page_table,
                page_size,
            } => {
                g.put_page_table(&page_table);
                (TopkOut::Slots, Some(page_size))
            }
        };
        let p = TopkParams {
            version: VERSION,
            k,
            row_stride: stride,
            output,
            short_rows: match op.short_rows {
                ShortRows::SelectValid => ShortRowsP::SelectValid,
                ShortRows::TakeAll => ShortRowsP::TakeAll,
            },
            page_size,
            next_n,
            conventions: Default::default(),
        };
        let mut out = vec![-1i32; n * k];
        for (r, range) in op.rows.iter().enumerate() {
            let row = &logits[r * stride..(r + 1) * stride];
            let want = topk_want(row, range, k, &op.output, op.short_rows);
            out[r * k..(r + 1) * k].copy_from_slice(&want);
        }
        g.set_params(Op::Topk, &p)?;
        g.put("logits", Dtype::F32, &[n, stride], logits);
        g.put("topk", Dtype::I32, &[n, k], &out);
        Ok(g)
    }

    /// A `sparse_mla` file; `out` (rounded to bf16) and `lse` (to f32) from
    /// [`reference::sparse_mla`].
    pub fn sparse_mla(op: &SparseMla, q: &[bf16], cache: &[u8], indices: &[i32]) -> Result<Golden> {
        let l = op.layout;
        let (t, h) = (op.n_tokens, op.n_heads);
        let pages = op
            .validate(
                std::mem::size_of_val(q),
                cache.len(),
                std::mem::size_of_val(indices),
                t * h * l.nope_dim() * 2,
                t * h * 4,
            )
            .map_err(GoldenError::Rejected)?;
        op.check_indices(indices, pages)
            .map_err(GoldenError::Rejected)?;
        let p = SparseMlaParams {
            version: VERSION,
            dtype: kv_dt(l.dtype()),
            nope_dim: l.nope_dim(),
            rope_dim: l.rope_dim(),
            page_size: l.page_size(),
            n_heads: h,
            topk: op.topk,
            softmax_scale: op.softmax_scale as f64,
            expected_from: ExpectedFrom::Reference,
            conventions: Default::default(),
        };
        let mut g = Golden::default();
        g.set_params(Op::SparseMla, &p)?;
        let want = reference::sparse_mla(&l, cache, q, indices, t, h, op.topk, op.softmax_scale);
        let out: Vec<bf16> = want.out.iter().map(|&x| bf16::from_f64(x)).collect();
        let lse: Vec<f32> = want.lse.iter().map(|&x| x as f32).collect();
        g.put("q", Dtype::BF16, &[t, h, l.d_qk()], q);
        g.put("cache", Dtype::U8, &[pages, l.bytes_per_page()], cache);
        g.put("indices", Dtype::I32, &[t, op.topk], indices);
        g.put("out", Dtype::BF16, &[t, h, l.nope_dim()], &out);
        g.put("lse", Dtype::F32, &[t, h], &lse);
        Ok(g)
    }
}
