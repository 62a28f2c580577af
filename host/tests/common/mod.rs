//! A small simulated model on top of `HiCache` for the cache tests: every token's KV and
//! index key are a deterministic function of the token prefix up to it and the layer, so
//! a cache hit must reproduce exactly the bytes the first computation stored.

#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::Arc;

use half::bf16;
use sparsekit_host::cache::{BufferKind, CacheConfig, CacheSpec, HiCache, PageRef, Prefix};
use sparsekit_host::layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout};
use sparsekit_host::ops::{IndexKStore, KvStore};
use sparsekit_host::{Backend, CpuBackend, Error, Result};

pub const PAGE: usize = 4;
pub const LAYERS: usize = 2;

pub fn spec(kv: KvDtype, ik: IndexKDtype) -> CacheSpec {
    CacheSpec::new(
        KvLayout::new(kv, 128, 16, PAGE).unwrap(),
        IndexKLayout::new(ik, 32, PAGE).unwrap(),
        LAYERS,
    )
    .unwrap()
}

pub fn cache(spec: CacheSpec, config: CacheConfig) -> HiCache<CpuBackend> {
    cache_on(CpuBackend::new(), spec, config)
}

pub fn cache_on<B: Backend + 'static>(
    backend: B,
    spec: CacheSpec,
    config: CacheConfig,
) -> HiCache<B> {
    HiCache::new(Arc::new(backend), spec, config).unwrap()
}

/// Hash of a token prefix (FNV-1a), the seed of its content.
fn prefix_hash(tokens: &[u32]) -> u64 {
    tokens.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &t| {
        (h ^ t as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// `n` bf16 values from a seed (xorshift), never all zero.
fn values(seed: u64, n: usize) -> Vec<bf16> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            bf16::from_f32(((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0)
        })
        .collect()
}

/// The simulated forward pass of one request.
pub struct Sim<'a, B: Backend + 'static> {
    pub cache: &'a HiCache<B>,
}

impl<B: Backend + 'static> Sim<'_, B> {
    /// Stores positions `from..tokens.len()` of every layer into `pages`.
    pub fn write(&self, tokens: &[u32], pages: &[PageRef], from: usize) -> Result<()> {
        let spec = *self.cache.spec();
        let b = self.cache.backend();
        let slots: Vec<i64> = (from..tokens.len())
            .map(|p| (pages[p / PAGE].id as usize * PAGE + p % PAGE) as i64)
            .collect();
        for l in 0..LAYERS {
            let mut kv = Vec::new();
            let mut ik = Vec::new();
            for p in from..tokens.len() {
                let h = prefix_hash(&tokens[..=p]) ^ (l as u64).wrapping_mul(0x9e37_79b9);
                kv.extend(values(h, spec.kv.d_qk()));
                ik.extend(values(h ^ 0xabcd, spec.index_k.head_dim()));
            }
            let mut layer = self.cache.layer_mut(l)?;
            b.kv_store(
                &KvStore {
                    layout: spec.kv,
                    slots: &slots,
                },
                &b.upload(bytemuck::cast_slice(&kv))?,
                &mut layer.kv,
            )?;
            b.index_k_store(
                &IndexKStore {
                    layout: spec.index_k,
                    slots: &slots,
                },
                &b.upload(bytemuck::cast_slice(&ik))?,
                &mut layer.index_k,
            )?;
        }
        Ok(())
    }

    /// The bytes of page `page` of `layer`/`kind`, read through a ready token.
    pub fn read(
        &self,
        prefix: &Prefix,
        layer: usize,
        kind: BufferKind,
        page: PageRef,
    ) -> Result<Vec<u8>> {
        let token = prefix.loads.wait(layer)?;
        let dev = self.cache.device();
        let view = match kind {
            BufferKind::Kv => dev.kv(&token)?,
            BufferKind::IndexK => dev.index_k(&token)?,
        };
        let all = self.cache.backend().download(view.buffer())?;
        Ok(all[dev.region(kind).page_range(page.id as usize)].to_vec())
    }
}

/// What every page of every prefix must contain, learned when it is first computed.
#[derive(Default)]
pub struct Expect {
    pages: HashMap<(u64, usize, BufferKind), Vec<u8>>,
    pub hits_checked: usize,
}

impl Expect {
    /// Runs one request: match, verify every cached page, compute the rest, commit, and
    /// finish (or abort before committing when `abort`). Returns the matched tokens.
    pub fn request<B: Backend + 'static>(
        &mut self,
        cache: &HiCache<B>,
        req: u64,
        tokens: &[u32],
        abort: bool,
    ) -> Result<usize> {
        let sim = Sim { cache };
        let prefix = cache.begin(req, tokens)?;
        let outcome = self.body(&sim, req, tokens, &prefix, abort);
        if outcome.is_err() || abort {
            cache.abort(req)?;
        } else {
            cache.finish(req)?;
        }
        outcome.map(|()| prefix.tokens)
    }

    fn body<B: Backend + 'static>(
        &mut self,
        sim: &Sim<'_, B>,
        req: u64,
        tokens: &[u32],
        prefix: &Prefix,
        abort: bool,
    ) -> Result<()> {
        for (i, &page) in prefix.pages.iter().enumerate() {
            let key = prefix_hash(&tokens[..(i + 1) * PAGE]);
            for l in 0..LAYERS {
                for kind in BufferKind::ALL {
                    let got = sim.read(prefix, l, kind, page)?;
                    let want = self.pages.get(&(key, l, kind)).ok_or_else(|| {
                        Error::Leak(format!("cache served a page never computed (page {i})"))
                    })?;
                    if &got != want {
                        return Err(Error::Integrity {
                            what: "served page",
                            page: page.id,
                            layer: l,
                            kind: kind.name(),
                            expected: 0,
                            actual: 1,
                        });
                    }
                    self.hits_checked += 1;
                }
            }
        }
        let need = tokens.len().div_ceil(PAGE) - prefix.pages.len();
        let fresh = sim.cache.alloc(req, need)?;
        let mut pages = prefix.pages.clone();
        pages.extend(&fresh);
        sim.write(tokens, &pages, prefix.tokens)?;
        if abort {
            return Ok(());
        }
        // Learn the full pages just computed.
        for i in prefix.pages.len()..tokens.len() / PAGE {
            let key = prefix_hash(&tokens[..(i + 1) * PAGE]);
            for l in 0..LAYERS {
                let mut layer = sim.cache.layer_mut(l)?;
                for kind in BufferKind::ALL {
                    let bytes = sim.cache.backend().download(layer.get_mut(kind))?;
                    let page = &bytes[sim
                        .cache
                        .device()
                        .region(kind)
                        .page_range(pages[i].id as usize)];
                    self.pages
                        .entry((key, l, kind))
                        .or_insert_with(|| page.to_vec());
                }
            }
        }
        sim.cache.commit(req, tokens, &pages)
    }
}
