//! Bench inputs: seeded random tensors (never all zeros), caches filled through the
//! backend's own store ops over shuffled (non-contiguous) page tables, and one ready-to-run
//! case per op.

use half::bf16;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sparsekit_host::ops::{
    decode_rows, IndexKStore, IndexerLogits, KvStore, PageTable, QueryRange, SparseMla, Topk,
    TopkOutput,
};
use sparsekit_host::{Backend, IndexKLayout, KvLayout, Result};

use crate::cost::{self, Cost};

/// The benches' random generator.
pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// A value with magnitude in `[0.05, 1)` times `scale`, random sign: never zero.
fn nonzero(rng: &mut impl Rng, scale: f32) -> f32 {
    let m: f32 = rng.gen_range(0.05..1.0);
    if rng.gen() {
        m * scale
    } else {
        -m * scale
    }
}

/// `n` bf16 values of magnitude in `[0.05, 1) × scale`, random sign (never zero).
pub fn bf16_values(rng: &mut impl Rng, n: usize, scale: f32) -> Vec<bf16> {
    (0..n)
        .map(|_| bf16::from_f32(nonzero(rng, scale)))
        .collect()
}

/// `n` f32 values of magnitude in `[0.05, 1) × scale`, random sign (never zero).
pub fn f32_values(rng: &mut impl Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| nonzero(rng, scale)).collect()
}

/// `n` standard-normal f32 values (Box-Muller).
pub fn normal_values(rng: &mut impl Rng, n: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        let u1: f64 = 1.0 - rng.gen::<f64>(); // (0, 1]
        let u2: f64 = rng.gen();
        let r = (-2.0 * u1.ln()).sqrt();
        let a = std::f64::consts::TAU * u2;
        out.push((r * a.cos()) as f32);
        out.push((r * a.sin()) as f32);
    }
    out.truncate(n);
    out
}

/// Little-endian bytes of bf16 values.
pub fn bf16_bytes(xs: &[bf16]) -> Vec<u8> {
    xs.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect()
}

/// Little-endian bytes of f32 values.
pub fn f32_bytes(xs: &[f32]) -> Vec<u8> {
    xs.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Little-endian bytes of i32 values.
pub fn i32_bytes(xs: &[i32]) -> Vec<u8> {
    xs.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A row-major `[n_requests, pages_per_request]` page table using a random permutation of
/// the pool's pages `0..n_requests·pages_per_request`: no request gets contiguous pages.
pub fn shuffled_page_table(
    rng: &mut impl Rng,
    n_requests: usize,
    pages_per_request: usize,
) -> Vec<i32> {
    let mut pages: Vec<i32> = (0..(n_requests * pages_per_request) as i32).collect();
    pages.shuffle(rng);
    pages
}

/// Tokens stored per `index_k_store` / `kv_store` call while filling a cache.
const STORE_CHUNK: usize = 16 * 1024;

/// Fills every slot of a new zeroed pool of `pool_bytes` with random rows of `dim` bf16
/// values, [`STORE_CHUNK`] slots per `store(slots, rows, cache)` call.
fn filled_cache<B: Backend>(
    backend: &B,
    rng: &mut impl Rng,
    pool_bytes: usize,
    slots_total: usize,
    dim: usize,
    store: impl Fn(&[i64], &B::Buffer, &mut B::Buffer) -> Result<()>,
) -> Result<B::Buffer> {
    let mut cache = backend.alloc(pool_bytes)?;
    for start in (0..slots_total).step_by(STORE_CHUNK) {
        let end = (start + STORE_CHUNK).min(slots_total);
        let slots: Vec<i64> = (start as i64..end as i64).collect();
        let rows = backend.upload(&bf16_bytes(&bf16_values(rng, slots.len() * dim, 1.0)))?;
        store(&slots, &rows, &mut cache)?;
    }
    Ok(cache)
}

/// Fills a whole paged index-K cache (every slot of every page) with random keys through
/// `backend.index_k_store`; returns the cache buffer.
pub fn filled_index_k_cache<B: Backend>(
    backend: &B,
    rng: &mut impl Rng,
    layout: IndexKLayout,
    num_pages: usize,
) -> Result<B::Buffer> {
    let slots_total = num_pages * layout.page_size();
    filled_cache(
        backend,
        rng,
        layout.buffer_bytes(num_pages),
        slots_total,
        layout.head_dim(),
        |slots, keys, cache| backend.index_k_store(&IndexKStore { layout, slots }, keys, cache),
    )
}

/// Fills a whole paged KV cache with random `[latent | rope]` tokens through
/// `backend.kv_store`; returns the cache buffer.
pub fn filled_kv_cache<B: Backend>(
    backend: &B,
    rng: &mut impl Rng,
    layout: KvLayout,
    num_pages: usize,
) -> Result<B::Buffer> {
    let slots_total = num_pages * layout.page_size();
    filled_cache(
        backend,
        rng,
        layout.buffer_bytes(num_pages),
        slots_total,
        layout.d_qk(),
        |slots, kv, cache| backend.kv_store(&KvStore { layout, slots }, kv, cache),
    )
}

/// Shape of an `indexer_logits` bench.
#[derive(Clone, Copy, Debug)]
pub struct IndexerLogitsShape {
    pub layout: IndexKLayout,
    pub n_heads: usize,
    pub batch: usize,
    pub context: usize,
    pub next_n: usize,
}

impl IndexerLogitsShape {
    /// The rows of the call (decode form, every request at `context`).
    pub fn rows(&self) -> Result<Vec<QueryRange>> {
        decode_rows(&vec![self.context as u32; self.batch], self.next_n)
    }

    /// See [`cost::indexer_logits`]; the row stride is the context.
    pub fn cost(&self) -> Result<Cost> {
        Ok(cost::indexer_logits(
            &self.layout,
            self.n_heads,
            &self.rows()?,
            self.context,
        ))
    }
}

/// A ready-to-run `indexer_logits` call: `batch` requests of `context` tokens each, their
/// pages a shuffled permutation of a pool that holds exactly them.
#[derive(Debug)]
pub struct IndexerLogitsCase<B: Backend> {
    pub shape: IndexerLogitsShape,
    pub pages: Vec<i32>,
    pub max_pages: usize,
    pub context_lens: Vec<u32>,
    pub q: B::Buffer,
    pub weights: B::Buffer,
    pub cache: B::Buffer,
    pub out: B::Buffer,
}

impl<B: Backend> IndexerLogitsCase<B> {
    pub fn build(backend: &B, shape: IndexerLogitsShape, seed: u64) -> Result<Self> {
        let mut rng = rng(seed);
        let l = shape.layout;
        let max_pages = shape.context.div_ceil(l.page_size());
        let pages = shuffled_page_table(&mut rng, shape.batch, max_pages);
        let cache = filled_index_k_cache(backend, &mut rng, l, pages.len())?;
        let rows = shape.batch * shape.next_n;
        let (h, d) = (shape.n_heads, l.head_dim());
        let q = backend.upload(&bf16_bytes(&bf16_values(&mut rng, rows * h * d, 1.0)))?;
        let w_scale = 1.0 / ((h * d) as f32).sqrt();
        let weights = backend.upload(&f32_bytes(&f32_values(&mut rng, rows * h, w_scale)))?;
        let out = backend.upload(&f32_bytes(&vec![f32::NAN; rows * shape.context]))?;
        Ok(IndexerLogitsCase {
            shape,
            pages,
            max_pages,
            context_lens: vec![shape.context as u32; shape.batch],
            q,
            weights,
            cache,
            out,
        })
    }

    /// The op descriptor (row stride = context).
    pub fn op(&self) -> Result<IndexerLogits<'_>> {
        IndexerLogits::decode(
            self.shape.layout,
            self.shape.n_heads,
            PageTable::new(&self.pages, self.max_pages)?,
            &self.context_lens,
            self.shape.next_n,
            self.shape.context,
        )
    }

    pub fn run(&mut self, backend: &B) -> Result<()> {
        let op = IndexerLogits::decode(
            self.shape.layout,
            self.shape.n_heads,
            PageTable::new(&self.pages, self.max_pages)?,
            &self.context_lens,
            self.shape.next_n,
            self.shape.context,
        )?;
        backend.indexer_logits(&op, &self.q, &self.weights, &self.cache, &mut self.out)
    }
}

/// Shape of a `topk` bench.
#[derive(Clone, Copy, Debug)]
pub struct TopkShape {
    pub rows: usize,
    pub context: usize,
    pub k: usize,
    pub page_size: usize,
}

impl TopkShape {
    /// See [`cost::topk`].
    pub fn cost(&self) -> Result<Cost> {
        Ok(cost::topk(
            &decode_rows(&vec![self.context as u32; self.rows], 1)?,
            self.k,
        ))
    }
}

/// A ready-to-run `topk` call: one row per request, standard-normal logits over the whole
/// context, output as cache slots through a shuffled page table.
#[derive(Debug)]
pub struct TopkCase<B: Backend> {
    pub shape: TopkShape,
    pub rows: Vec<QueryRange>,
    pub pages: Vec<i32>,
    pub max_pages: usize,
    pub logits: B::Buffer,
    pub out: B::Buffer,
}

impl<B: Backend> TopkCase<B> {
    pub fn build(backend: &B, shape: TopkShape, seed: u64) -> Result<Self> {
        let mut rng = rng(seed);
        let max_pages = shape.context.div_ceil(shape.page_size);
        let pages = shuffled_page_table(&mut rng, shape.rows, max_pages);
        let rows = decode_rows(&vec![shape.context as u32; shape.rows], 1)?;
        let logits = backend.upload(&f32_bytes(&normal_values(
            &mut rng,
            shape.rows * shape.context,
        )))?;
        let out = backend.upload(&i32_bytes(&vec![-7; shape.rows * shape.k]))?;
        Ok(TopkCase {
            shape,
            rows,
            pages,
            max_pages,
            logits,
            out,
        })
    }

    pub fn run(&mut self, backend: &B) -> Result<()> {
        let op = Topk {
            short_rows: sparsekit_host::ops::ShortRows::SelectValid,
            k: self.shape.k,
            row_stride: self.shape.context,
            rows: &self.rows,
            output: TopkOutput::Slots {
                page_table: PageTable::new(&self.pages, self.max_pages)?,
                page_size: self.shape.page_size,
            },
        };
        backend.topk(&op, &self.logits, &mut self.out)
    }
}

/// Shape of a `sparse_mla` bench.
#[derive(Clone, Copy, Debug)]
pub struct SparseMlaShape {
    pub layout: KvLayout,
    pub n_tokens: usize,
    pub n_heads: usize,
    pub topk: usize,
    /// Pages in the KV pool the slots are drawn from.
    pub pool_pages: usize,
}

impl SparseMlaShape {
    /// See [`cost::sparse_mla`]: every selected slot is valid while `topk` fits the pool.
    pub fn cost(&self) -> Cost {
        let valid = self.topk.min(self.pool_pages * self.layout.page_size());
        let mut idx = vec![0i32; valid];
        idx.resize(self.topk, -1);
        let per_token = cost::sparse_mla(&self.layout, 1, self.n_heads, &idx);
        Cost {
            bytes: per_token.bytes * self.n_tokens as u64,
            flops: per_token.flops * self.n_tokens as u64,
            bf16_dot: true,
            tiles: false,
        }
    }
}

/// A ready-to-run `sparse_mla` call: every token attends to `topk` distinct random valid
/// slots of a fully written pool, in random order.
#[derive(Debug)]
pub struct SparseMlaCase<B: Backend> {
    pub shape: SparseMlaShape,
    pub indices_host: Vec<i32>,
    pub q: B::Buffer,
    pub cache: B::Buffer,
    pub indices: B::Buffer,
    pub out: B::Buffer,
    pub lse: B::Buffer,
}

impl<B: Backend> SparseMlaCase<B> {
    pub fn build(backend: &B, shape: SparseMlaShape, seed: u64) -> Result<Self> {
        let mut rng = rng(seed);
        let l = shape.layout;
        let cache = filled_kv_cache(backend, &mut rng, l, shape.pool_pages)?;
        let capacity = shape.pool_pages * l.page_size();
        let mut indices_host = Vec::with_capacity(shape.n_tokens * shape.topk);
        for _ in 0..shape.n_tokens {
            let picked = rand::seq::index::sample(&mut rng, capacity, shape.topk.min(capacity));
            indices_host.extend(picked.into_iter().map(|s| s as i32));
            indices_host.resize(indices_host.len() + shape.topk.saturating_sub(capacity), -1);
        }
        let (t, h) = (shape.n_tokens, shape.n_heads);
        // Real q·k logits are O(1)-O(10) after the softmax scale; random ±1 q over 576 dims
        // gives that range too.
        let q = backend.upload(&bf16_bytes(&bf16_values(&mut rng, t * h * l.d_qk(), 1.0)))?;
        let indices = backend.upload(&i32_bytes(&indices_host))?;
        let out = backend.upload(&bf16_bytes(&vec![bf16::NAN; t * h * l.nope_dim()]))?;
        let lse = backend.upload(&f32_bytes(&vec![f32::NAN; t * h]))?;
        Ok(SparseMlaCase {
            shape,
            indices_host,
            q,
            cache,
            indices,
            out,
            lse,
        })
    }

    pub fn op(&self) -> SparseMla {
        SparseMla {
            layout: self.shape.layout,
            n_tokens: self.shape.n_tokens,
            n_heads: self.shape.n_heads,
            topk: self.shape.topk,
            softmax_scale: 1.0 / (self.shape.layout.d_qk() as f32).sqrt(),
        }
    }

    pub fn cost(&self) -> Cost {
        cost::sparse_mla(
            &self.shape.layout,
            self.shape.n_tokens,
            self.shape.n_heads,
            &self.indices_host,
        )
    }

    pub fn run(&mut self, backend: &B) -> Result<()> {
        let op = self.op();
        backend.sparse_mla(
            &op,
            &self.q,
            &self.cache,
            &self.indices,
            &mut self.out,
            &mut self.lse,
        )
    }
}

#[cfg(test)]
#[allow(
    clippy::unwrap_used,
    reason = "tests: a failure panics with its message"
)]
mod tests {
    use super::*;
    use sparsekit_host::{CpuBackend, IndexKDtype, KvDtype};

    fn f32s(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    #[test]
    fn page_table_is_a_non_contiguous_permutation() {
        let mut r = rng(1);
        let p = shuffled_page_table(&mut r, 4, 16);
        let mut sorted = p.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..64).collect::<Vec<_>>());
        assert_ne!(p, sorted);
    }

    #[test]
    fn small_cases_run_and_fill_every_output() {
        let be = CpuBackend::new();
        for dtype in [IndexKDtype::FP8, IndexKDtype::Bf16] {
            let shape = IndexerLogitsShape {
                layout: IndexKLayout::new(dtype, 128, 64).unwrap(),
                n_heads: 8,
                batch: 2,
                context: 300,
                next_n: 1,
            };
            let mut case = IndexerLogitsCase::build(&be, shape, 3).unwrap();
            // The cache holds real data in every page.
            let cache = be.download(&case.cache).unwrap();
            for page in cache.chunks_exact(shape.layout.bytes_per_page()) {
                assert!(page.iter().any(|&b| b != 0));
            }
            case.run(&be).unwrap();
            let out = f32s(&be.download(&case.out).unwrap());
            assert!(out.iter().all(|x| x.is_finite()));
            assert!(out.iter().any(|&x| x != 0.0));
            assert!(shape.cost().unwrap().flops > 0);
            assert_eq!(case.op().unwrap().rows, shape.rows().unwrap());
        }

        let shape = TopkShape {
            rows: 3,
            context: 5000,
            k: 64,
            page_size: 64,
        };
        let mut case = TopkCase::build(&be, shape, 4).unwrap();
        case.run(&be).unwrap();
        let out = be.download(&case.out).unwrap();
        let pool = (shape.rows * shape.context.div_ceil(64) * 64) as i32;
        assert!(i32_from(&out).iter().all(|&s| (0..pool).contains(&s)));

        for dtype in [KvDtype::Bf16, KvDtype::Fp8DsMla] {
            let shape = SparseMlaShape {
                layout: KvLayout::new(dtype, 512, 64, 64).unwrap(),
                n_tokens: 2,
                n_heads: 16,
                topk: 100,
                pool_pages: 4,
            };
            let mut case = SparseMlaCase::build(&be, shape, 5).unwrap();
            for row in case.indices_host.chunks(shape.topk) {
                let mut r = row.to_vec();
                r.sort_unstable();
                r.dedup();
                assert_eq!(r.len(), shape.topk);
                assert!(r.iter().all(|&s| (0..256).contains(&s)));
            }
            assert_eq!(case.cost(), shape.cost());
            case.run(&be).unwrap();
            let lse = f32s(&be.download(&case.lse).unwrap());
            assert!(lse.iter().all(|x| x.is_finite()));
        }
    }

    fn i32_from(b: &[u8]) -> Vec<i32> {
        b.chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
}
