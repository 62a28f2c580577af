//! Random inputs for the suite: ragged batches over paged pools with shuffled,
//! non-contiguous pages, unmapped pages full of garbage bytes, and keys whose magnitudes
//! vary per token (tiny tokens below the scale floor, outliers beyond 448). Never zeros.

use half::bf16;
use rand::seq::SliceRandom;
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sparsekit_host::layout::{IndexKLayout, KvLayout};

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
        self.table[r * self.max_pages + pos / self.page_size] as i64 * self.page_size as i64
            + (pos % self.page_size) as i64
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
