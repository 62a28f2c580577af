//! Random inputs for the suite, the conformance checks and the golden tests: ragged batches over paged pools with shuffled,
//! non-contiguous pages, unmapped pages full of garbage bytes, and keys whose magnitudes
//! vary per token (tiny tokens below the scale floor, outliers beyond 448). Never zeros.

use half::bf16;
use rand::seq::SliceRandom;
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sparsekit_host::dims::ModelDims;
use sparsekit_host::layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout, PageLayout, SlotAddr};
use sparsekit_host::ops::{PagedRegion, QueryRange};

use crate::reference;

/// The suite's RNG.
pub type SuiteRng = ChaCha8Rng;

/// A fresh RNG for a case: the suite seed mixed with the case's index.
pub fn case_rng(seed: u64, case: u64) -> SuiteRng {
    ChaCha8Rng::seed_from_u64(seed ^ case.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// A standard normal sample (Box–Muller).
pub fn normal(rng: &mut SuiteRng) -> f64 {
    let u1: f64 = rng.gen_range(f64::EPSILON..1.0);
    let u2: f64 = rng.gen();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// `n` bf16 values ~ N(0, scale²).
pub fn bf16_normal(rng: &mut SuiteRng, n: usize, scale: f64) -> Vec<bf16> {
    (0..n)
        .map(|_| bf16::from_f64(normal(rng) * scale))
        .collect()
}

/// `n_tokens` rows of `dim` bf16 values with a random magnitude per token: mostly
/// 2^U(-6, 4), some below the 1e-4 scale floor, some with outliers up to ~2000.
pub fn token_rows(rng: &mut SuiteRng, n_tokens: usize, dim: usize) -> Vec<bf16> {
    let mut out = Vec::with_capacity(n_tokens * dim);
    for _ in 0..n_tokens {
        let kind = rng.gen_range(0..20);
        let scale = match kind {
            0 => 1e-6,
            1 => 300.0,
            _ => 2f64.powf(rng.gen_range(-6.0..4.0)),
        };
        let start = out.len();
        out.extend(bf16_normal(rng, dim, scale));
        if kind == 2 {
            let i = rng.gen_range(0..dim);
            out[start + i] = bf16::from_f64(if rng.gen() { 2000.0 } else { -1500.0 });
        }
    }
    out
}

/// Random bytes (garbage in pages nobody should read).
pub fn garbage(rng: &mut SuiteRng, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rng.fill_bytes(&mut v);
    v
}

/// Per-request page tables over a pool: each request gets `ceil(len / page_size)` distinct
/// random pages; rows are padded with `-1` to `max_pages` (plus `slack` extra `-1`s).
#[derive(Clone, Debug)]
pub struct Paging {
    pub page_size: usize,
    pub num_pages: usize,
    pub max_pages: usize,
    pub table: Vec<i32>,
    pub lens: Vec<u32>,
}

impl Paging {
    /// Allocates pages for `lens` from a pool with `spare` unused pages besides.
    pub fn new(rng: &mut SuiteRng, page_size: usize, lens: &[u32], spare: usize) -> Paging {
        let needed: Vec<usize> = lens
            .iter()
            .map(|&l| (l as usize).div_ceil(page_size))
            .collect();
        let total: usize = needed.iter().sum();
        let num_pages = total + spare;
        let mut ids: Vec<i32> = (0..num_pages as i32).collect();
        ids.shuffle(rng);
        let max_pages = needed.iter().copied().max().unwrap_or(0) + 1;
        let mut table = vec![-1; lens.len() * max_pages];
        let mut next = ids.into_iter();
        for (r, &n) in needed.iter().enumerate() {
            for p in 0..n {
                table[r * max_pages + p] = next.next().unwrap_or(-1);
            }
        }
        Paging {
            page_size,
            num_pages,
            max_pages,
            table,
            lens: lens.to_vec(),
        }
    }

    /// Slot of position `pos` of request `r`.
    pub fn slot(&self, r: usize, pos: usize) -> i64 {
        let at = SlotAddr::of(pos, self.page_size);
        let page = self.table[r * self.max_pages + at.page];
        page as i64 * self.page_size as i64 + at.offset as i64
    }

    /// Slots of every position of every request, request-major.
    pub fn all_slots(&self) -> Vec<i64> {
        (0..self.lens.len())
            .flat_map(|r| (0..self.lens[r] as usize).map(move |p| self.slot(r, p)))
            .collect()
    }
}

/// An index-K pool whose requests' positions hold random keys (written by the reference
/// store) and whose other bytes are garbage.
pub fn index_k_pool(rng: &mut SuiteRng, layout: &IndexKLayout, paging: &Paging) -> Vec<u8> {
    let mut cache = garbage(rng, layout.buffer_bytes(paging.num_pages));
    let slots = paging.all_slots();
    let keys = token_rows(rng, slots.len(), layout.head_dim());
    reference::index_k_store(layout, &mut cache, &keys, &slots);
    cache
}

/// A KV pool whose requests' positions hold random tokens; other bytes are garbage.
pub fn kv_pool(rng: &mut SuiteRng, layout: &KvLayout, paging: &Paging) -> Vec<u8> {
    let mut cache = garbage(rng, layout.buffer_bytes(paging.num_pages));
    let slots = paging.all_slots();
    let kv = token_rows(rng, slots.len(), layout.d_qk());
    reference::kv_store(layout, &mut cache, &kv, &slots);
    cache
}

/// Bytes of a host slice of plain values.
pub fn bytes_of<T: bytemuck::Pod>(v: &[T]) -> &[u8] {
    bytemuck::cast_slice(v)
}

/// A buffer of `n` f32 NaNs (poison for f32 outputs).
pub fn poison_f32(n: usize) -> Vec<u8> {
    bytemuck::cast_slice(&vec![f32::NAN; n]).to_vec()
}

/// A buffer of `n` bf16 NaNs (poison for bf16 outputs).
pub fn poison_bf16(n: usize) -> Vec<u8> {
    bytemuck::cast_slice(&vec![bf16::NAN; n]).to_vec()
}

/// A buffer of `n` i32 holding the bits of f32 NaN (poison for index outputs: never a
/// valid slot, never `-1`).
pub fn poison_i32(n: usize) -> Vec<u8> {
    poison_f32(n)
}

/// The shape of a top-k case's logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scenario {
    /// Standard normal.
    Random,
    /// Every entry equal.
    AllEqual,
    /// k/2 large values, then thousands of copies of the threshold value.
    ThresholdTies,
    /// Mixed with `-inf`, NaN and signed zeros.
    Invalid,
}

/// New tokens for a store case: 5 requests with existing lengths and 1..=40 new tokens
/// (one crossing a page boundary), plus `-1` padding entries. Returns (paging, slots).
pub fn store_batch(rng: &mut SuiteRng, page_size: usize) -> (Paging, Vec<i64>) {
    let existing: Vec<u32> = (0..5).map(|_| rng.gen_range(0..200)).collect();
    let new: Vec<u32> = (0..5)
        .map(|i| {
            if i == 0 {
                page_size as u32 + 1
            } else {
                rng.gen_range(1..=40)
            }
        })
        .collect();
    let lens: Vec<u32> = existing.iter().zip(&new).map(|(a, b)| a + b).collect();
    let paging = Paging::new(rng, page_size, &lens, 2);
    let mut slots = Vec::new();
    for r in 0..5 {
        for p in existing[r]..lens[r] {
            slots.push(paging.slot(r, p as usize));
        }
        if r % 2 == 1 {
            slots.push(-1);
        }
    }
    (paging, slots)
}

/// Prefill rows: per request, up to 4 queries at its last positions (causal), and for
/// every other request one extra row with a window `start > 0`.
pub fn prefill_rows(rng: &mut SuiteRng, lens: &[u32]) -> Vec<QueryRange> {
    let mut rows = Vec::new();
    for (r, &len) in lens.iter().enumerate() {
        let nq = rng.gen_range(1..=4u32).min(len);
        for i in 0..nq {
            rows.push(QueryRange {
                request: r as u32,
                start: 0,
                end: len - nq + i + 1,
            });
        }
        if r % 2 == 1 && len > 2 {
            let start = rng.gen_range(1..len - 1);
            rows.push(QueryRange {
                request: r as u32,
                start,
                end: len,
            });
        }
    }
    rows
}

/// Random indexer queries and weights for `n_rows` rows.
pub fn indexer_inputs(
    rng: &mut SuiteRng,
    n_rows: usize,
    h: usize,
    d: usize,
) -> (Vec<bf16>, Vec<f32>) {
    let q = bf16_normal(rng, n_rows * h * d, 1.0);
    let w = (0..n_rows * h)
        .map(|_| (normal(rng) / (h as f64 * d as f64).sqrt()) as f32)
        .collect();
    (q, w)
}

/// Random logits for top-k rows of the given lengths (columns past a row's length are
/// `-inf`), shaped by the scenario.
pub fn topk_logits(
    rng: &mut SuiteRng,
    k: usize,
    sc: Scenario,
    lens: &[u32],
    stride: usize,
) -> Vec<f32> {
    let mut logits = vec![f32::NEG_INFINITY; lens.len() * stride];
    for (r, &len) in lens.iter().enumerate() {
        let row = &mut logits[r * stride..r * stride + len as usize];
        for x in row.iter_mut() {
            *x = normal(rng) as f32;
        }
        match sc {
            Scenario::Random => {}
            Scenario::AllEqual => row.fill(1.5),
            Scenario::ThresholdTies if row.is_empty() => {}
            Scenario::ThresholdTies => {
                // k/2 large distinct values, then thousands of copies of the threshold value.
                let n = row.len();
                for x in row.iter_mut() {
                    *x = (*x).min(0.5);
                }
                for _ in 0..k / 2 {
                    row[rng.gen_range(0..n)] = 10.0 + rng.gen::<f32>();
                }
                let ties = (k + 3000).min(n);
                for _ in 0..ties {
                    row[rng.gen_range(0..n)] = 0.75;
                }
            }
            Scenario::Invalid => {
                for x in row.iter_mut() {
                    match rng.gen_range(0..10) {
                        0 => *x = f32::NEG_INFINITY,
                        1 => *x = f32::NAN,
                        2 => *x = -0.0,
                        3 => *x = 0.0,
                        _ => {}
                    }
                }
            }
        }
    }
    logits
}

/// Per-token slot lists for sparse MLA: token 0 has no valid slot, token 1 fewer than
/// `topk`, the rest `min(topk, len)` distinct random positions of their request, all
/// shuffled with some `-1` entries mixed in.
pub fn mla_indices(rng: &mut SuiteRng, paging: &Paging, n_tokens: usize, topk: usize) -> Vec<i32> {
    let n_req = paging.lens.len();
    let mut idx = vec![-1i32; n_tokens * topk];
    for t in 0..n_tokens {
        let r = t % n_req;
        let len = paging.lens[r] as usize;
        let want = match t {
            0 => 0,
            1 => (topk / 3).min(len),
            _ => topk.min(len),
        };
        let mut pos: Vec<usize> = (0..len).collect();
        pos.shuffle(rng);
        let row = &mut idx[t * topk..(t + 1) * topk];
        for (dst, &p) in row.iter_mut().zip(&pos[..want]) {
            *dst = paging.slot(r, p) as i32;
        }
        row.shuffle(rng);
    }
    idx
}

/// A region of `num_pages` pages of `layout`: contiguous, or page-first (each page slot
/// also holds a foreign page of `extra` bytes before it, as in a multi-layer host pool).
pub fn region(layout: PageLayout, num_pages: usize, page_first: bool, extra: usize) -> PagedRegion {
    if page_first {
        PagedRegion {
            layout,
            offset: extra,
            stride: layout.bytes_per_page() + extra,
            num_pages,
        }
    } else {
        PagedRegion::contiguous(layout, num_pages)
    }
}

/// Bytes of a buffer holding `r` (every page slot whole).
pub fn region_bytes(r: &PagedRegion) -> usize {
    r.offset + r.stride * r.num_pages
}

/// DeepSeek-V4's page layouts with pages of `page_size` tokens: KV `model1_fp8` and
/// `bf16_512`, index-K fp4 (head_dim 128).
pub fn v4_page_layouts(page_size: usize) -> Vec<PageLayout> {
    let mut v: Vec<PageLayout> = Vec::new();
    if let Ok(l) = KvLayout::model1_fp8(page_size) {
        v.push(l.into());
    }
    if let Ok(l) = KvLayout::bf16_512(page_size) {
        v.push(l.into());
    }
    if let Ok(l) = IndexKLayout::new(IndexKDtype::Fp4E2m1, 128, page_size) {
        v.push(l.into());
    }
    v
}

/// Every page layout of a model config: index-K fp8 and bf16, KV bf16 and fp8_ds_mla.
pub fn page_layouts(d: &ModelDims) -> Vec<PageLayout> {
    let mut v = Vec::new();
    for dt in [IndexKDtype::FP8, IndexKDtype::Bf16] {
        if let Ok(l) = IndexKLayout::new(dt, d.index_head_dim, d.page_size) {
            v.push(l.into());
        }
    }
    for dt in [KvDtype::Bf16, KvDtype::Fp8DsMla] {
        if let Ok(l) = KvLayout::new(dt, d.kv_lora_rank, d.qk_rope_dim, d.page_size) {
            v.push(l.into());
        }
    }
    v
}
