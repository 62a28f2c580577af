//! The cache over a DeepSeek-V4 spec: five pools with different page sizes behind one page
//! table (the window's raw KV, the CSA layers' compressed index keys and compressed KV,
//! the HCA layers' compressed KV, the compressor state at each page's end), through the
//! host tier and its checks, and the V4 forms of the historical host-tier bugs, each
//! caught by two independent checks and served corrupted with both off.
//!
//! A small simulated model fills the pools: every entry is a deterministic function of
//! the token prefix up to the entry's last token, the layer and the pool, so a cache hit
//! must reproduce exactly the bytes the first computation stored.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

mod common;

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use common::{cache, prefix_hash, prompt};
use half::bf16;
use sparsekit_host::cache::{
    BufferKind, CacheConfig, CacheSpec, Fault, Faults, HiCache, HostLayout, LayerGuard, PageRef,
    Prefix, ReadExtent, SlotRef,
};
use sparsekit_host::layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout};
use sparsekit_host::{Backend, CpuBackend, Error, Result};

/// Raw tokens per page (the window pool's page size).
const TPP: usize = 16;
/// Per layer: 0 window only, 4 CSA, 8 HCA (V4's 128, scaled to the small page).
const RATIOS: [usize; 4] = [0, 4, 8, 4];

fn v4_spec(kv: KvDtype, ik: IndexKDtype) -> CacheSpec {
    let row = |p| KvLayout::new(kv, 448, 64, p).unwrap();
    CacheSpec::v4(
        row(TPP),
        IndexKLayout::new(ik, 128, TPP / 4).unwrap(),
        row(TPP / 4),
        row(TPP / 8),
        KvLayout::new(KvDtype::Bf16, 112, 16, 1).unwrap(),
        &RATIOS,
    )
    .unwrap()
}

/// bf16 values per entry of `kind` (what `store_kind` takes).
fn width(spec: &CacheSpec, kind: BufferKind) -> usize {
    match kind {
        BufferKind::IndexK => spec.index_k.head_dim(),
        k => match spec.layout(k) {
            sparsekit_host::layout::PageLayout::Kv(l) => l.d_qk(),
            sparsekit_host::layout::PageLayout::IndexK(l) => l.head_dim(),
        },
    }
}

/// `n` bf16 values from a seed (xorshift), never all zero, of magnitude ≤ 4.
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

/// The rows of entry `e` of `kind` in layer `l`: a function of the tokens up to the
/// entry's last one.
fn entry(spec: &CacheSpec, tokens: &[u32], kind: BufferKind, l: usize, e: usize) -> Vec<bf16> {
    let last = (e + 1) * spec.tokens_per_entry(kind) - 1;
    let h = prefix_hash(&tokens[..=last])
        ^ (l as u64).wrapping_mul(0x9e37_79b9)
        ^ (kind.index() as u64 + 1).wrapping_mul(0x2545_f491_4f6c_dd1d);
    values(h, width(spec, kind))
}

/// The simulated forward pass of layer `g.layer()` over `tokens[from..]`: stores every
/// entry of every pool the layer holds that the new tokens complete, except the pools in
/// `skip` (a model that forgets one).
fn store_layer(
    g: &mut LayerGuard<'_, CpuBackend>,
    b: &CpuBackend,
    spec: &CacheSpec,
    tokens: &[u32],
    pages: &[PageRef],
    from: usize,
    skip: &[BufferKind],
) -> Result<()> {
    let l = g.layer();
    for kind in spec.kinds(l).collect::<Vec<_>>() {
        if skip.contains(&kind) {
            continue;
        }
        let tpe = spec.tokens_per_entry(kind);
        let epp = spec.entries_per_page(kind);
        let entries = from / tpe..tokens.len() / tpe;
        if entries.is_empty() {
            continue;
        }
        let mut slots = Vec::new();
        let mut rows = Vec::new();
        for e in entries {
            slots.push(SlotRef {
                page: pages[e / epp],
                offset: (e % epp) as u32,
            });
            rows.extend(entry(spec, tokens, kind, l, e));
        }
        g.store_kind(kind, &slots, &b.upload(bytemuck::cast_slice(&rows))?)?;
    }
    Ok(())
}

/// The bytes of `pages` of every pool of the guard's layer, `[page][kind]` (empty for a
/// pool the layer lacks).
fn read_pages(
    cache: &HiCache<CpuBackend>,
    g: &LayerGuard<'_, CpuBackend>,
    pages: &[PageRef],
) -> Result<Vec<Vec<Vec<u8>>>> {
    let spec = *cache.spec();
    let mut out = vec![vec![Vec::new(); BufferKind::ALL.len()]; pages.len()];
    for kind in spec.kinds(g.layer()).collect::<Vec<_>>() {
        let bytes = cache.backend().download(g.view(kind, &[])?)?;
        let r = cache.device_region(kind);
        for (i, p) in pages.iter().enumerate() {
            out[i][kind.index()] = bytes[r.page_range(p.id as usize)].to_vec();
        }
    }
    Ok(out)
}

/// A page's bytes per pool (`[kind.index()]`) by (token prefix hash, layer).
type PageBytes = HashMap<(u64, usize), Vec<Vec<u8>>>;

/// What every page of every prefix must hold, learned when first computed.
#[derive(Default)]
struct Expect {
    pages: Mutex<PageBytes>,
}

impl Expect {
    fn check_or_learn(&self, tokens: &[u32], i: usize, l: usize, got: Vec<Vec<u8>>) -> Result<()> {
        let key = (prefix_hash(&tokens[..(i + 1) * TPP]), l);
        let mut map = self.pages.lock().unwrap();
        match map.get(&key) {
            None => {
                map.insert(key, got);
                Ok(())
            }
            Some(want) => match BufferKind::ALL
                .into_iter()
                .find(|k| want[k.index()] != got[k.index()])
            {
                None => Ok(()),
                Some(k) => Err(Error::Integrity {
                    what: "served page",
                    page: i as u32,
                    layer: l,
                    kind: k.name(),
                    expected: 0,
                    actual: 1,
                }),
            },
        }
    }

    /// One request: begin, one step (check every cached page of every pool, compute the
    /// rest, skipping `skip`), commit, finish. Returns the matched tokens.
    fn request(
        &self,
        cache: &HiCache<CpuBackend>,
        req: u64,
        tokens: &[u32],
        skip: &[BufferKind],
    ) -> Result<usize> {
        let prefix = cache.begin(req, tokens)?;
        let outcome = self.body(cache, req, tokens, &prefix, skip);
        if outcome.is_err() {
            cache.abort(req)?;
        } else {
            cache.finish(req)?;
        }
        outcome.map(|()| prefix.tokens)
    }

    fn body(
        &self,
        cache: &HiCache<CpuBackend>,
        req: u64,
        tokens: &[u32],
        prefix: &Prefix,
        skip: &[BufferKind],
    ) -> Result<()> {
        let spec = *cache.spec();
        let need = tokens.len().div_ceil(TPP) - prefix.pages.len();
        let mut pages = prefix.pages.clone();
        pages.extend(cache.alloc(req, need)?);
        let n_prefix = prefix.pages.len();
        {
            let mut step = cache.step(&[req])?;
            for l in 0..spec.num_layers {
                let mut g = step.wait_layer(l)?;
                for (i, got) in read_pages(cache, &g, &pages[..n_prefix])?
                    .into_iter()
                    .enumerate()
                {
                    self.check_or_learn(tokens, i, l, got)?;
                }
                store_layer(
                    &mut g,
                    cache.backend(),
                    &spec,
                    tokens,
                    &pages,
                    prefix.tokens,
                    skip,
                )?;
                let full = tokens.len() / TPP;
                for (k, got) in read_pages(cache, &g, &pages[n_prefix..full])?
                    .into_iter()
                    .enumerate()
                {
                    self.check_or_learn(tokens, n_prefix + k, l, got)?;
                }
            }
        }
        cache.commit(req, tokens, &pages)
    }
}

/// The cause of a request's failure.
fn cause(e: Error) -> Error {
    match e {
        Error::RequestFailed { cause, .. } => *cause,
        e => e,
    }
}

#[test]
fn the_v4_spec_holds_each_pool_in_its_layers_with_its_own_page_size() {
    let s = v4_spec(KvDtype::Model1Fp8, IndexKDtype::Fp4E2m1);
    assert_eq!(s.page_size(), TPP);
    let kinds = |l| s.kinds(l).collect::<Vec<_>>();
    use BufferKind::*;
    assert_eq!(kinds(0), [Kv]);
    assert_eq!(kinds(1), [Kv, IndexK, CsaKv, State]);
    assert_eq!(kinds(2), [Kv, HcaKv, State]);
    assert_eq!(
        [Kv, IndexK, CsaKv, HcaKv, State].map(|k| (s.entries_per_page(k), s.tokens_per_entry(k))),
        [(16, 1), (4, 4), (4, 4), (2, 8), (1, 16)]
    );
    // Page strides from the descriptors: MODEL1 rounds to 576-byte multiples.
    assert_eq!(
        s.layout(Kv).bytes_per_page(),
        (16 * 584usize).div_ceil(576) * 576
    );
    assert_eq!(s.layout(HcaKv).bytes_per_page(), 1728);
    // A second HCA ratio, a ratio that does not divide the page, or a pool whose page is
    // not the window page's span are refused.
    let row = |p| KvLayout::new(KvDtype::Bf16x512, 448, 64, p).unwrap();
    let ik = IndexKLayout::new(IndexKDtype::FP8, 128, 4).unwrap();
    let st = KvLayout::new(KvDtype::Bf16, 112, 16, 1).unwrap();
    assert!(CacheSpec::v4(row(16), ik, row(4), row(2), st, &[0, 8, 16]).is_err());
    assert!(CacheSpec::v4(row(16), ik, row(4), row(4), st, &[0, 4, 8]).is_err());
    assert!(CacheSpec::v4(row(16), ik, row(8), row(2), st, &[0, 4, 8]).is_err());
    // The whole-spec fingerprint sees every pool.
    assert_ne!(
        s.fingerprint(),
        v4_spec(KvDtype::Bf16x512, IndexKDtype::Fp4E2m1).fingerprint()
    );
}

/// Every pool of every layer comes back bit-exact from the host tier, in every layout
/// combination and both host layouts; the landed stamps and checksums cover all of them.
#[test]
fn every_pool_round_trips_through_the_host_tier() {
    for kv in [KvDtype::Model1Fp8, KvDtype::Bf16x512] {
        for ik in [IndexKDtype::Fp4E2m1, IndexKDtype::FP8, IndexKDtype::Bf16] {
            for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
                let mut cfg = CacheConfig::new(6, 16);
                cfg.host_layout = layout;
                let c = cache(v4_spec(kv, ik), cfg);
                let e = Expect::default();
                let a = prompt(1, 4 * TPP + 5);
                assert_eq!(e.request(&c, 1, &a, &[]).unwrap(), 0);
                // Another prompt fills the device and pushes `a` to the host tier.
                assert_eq!(e.request(&c, 2, &prompt(2, 5 * TPP), &[]).unwrap(), 0);
                let s = c.leak_check().unwrap();
                assert!(s.backups > 0 && s.host_cached > 0, "{s:?}");
                // `a` again: its 4 full pages, every pool, from the host tier, verified.
                assert_eq!(e.request(&c, 3, &a, &[]).unwrap(), 4 * TPP);
                let s = c.leak_check().unwrap();
                assert!(s.hits_host_pages >= 3, "{kv:?} {ik:?} {layout:?}: {s:?}");
                assert_eq!((s.integrity_failures, s.device_in_use), (0, 0));
            }
        }
    }
}

/// A page is committed (shareable) only when every pool of every layer holds all its
/// entries: a model that forgets one pool cannot publish the page.
#[test]
fn a_commit_missing_any_pool_is_refused() {
    for kind in [
        BufferKind::IndexK,
        BufferKind::CsaKv,
        BufferKind::HcaKv,
        BufferKind::State,
    ] {
        let c = cache(
            v4_spec(KvDtype::Model1Fp8, IndexKDtype::FP8),
            CacheConfig::new(6, 0),
        );
        let e = Expect::default();
        let err = e.request(&c, 1, &prompt(1, 2 * TPP), &[kind]).unwrap_err();
        // Refused at commit (the page's pool never landed) naming the pool.
        assert!(
            matches!(
                cause(err.clone()),
                Error::Unwritten { kind: k, .. } | Error::NotLanded { kind: k, .. }
                    if k == kind.name()
            ),
            "{kind:?}: {err:?}"
        );
        let s = c.leak_check().unwrap();
        assert_eq!(
            s.device_cached, 0,
            "nothing of the half-written prompt is shared"
        );
    }
}

/// A read of compressed entries that were never written is refused, per pool: the read
/// extent of a request counts each pool's complete entries.
#[test]
fn a_read_of_unwritten_compressed_entries_is_refused() {
    let c = cache(
        v4_spec(KvDtype::Bf16x512, IndexKDtype::Bf16),
        CacheConfig::new(4, 0),
    );
    let spec = *c.spec();
    let a = prompt(3, TPP + 9);
    let prefix = c.begin(1, &a).unwrap();
    let pages = c.alloc(1, 2).unwrap();
    {
        let mut step = c.step(&[1]).unwrap();
        let mut g = step.wait_layer(1).unwrap();
        // The window KV and index keys of every token; no compressed KV.
        store_layer(
            &mut g,
            c.backend(),
            &spec,
            &a,
            &pages,
            0,
            &[BufferKind::CsaKv, BufferKind::State],
        )
        .unwrap();
        let read = [ReadExtent {
            request: 1,
            pages: &pages,
            tokens: a.len(),
        }];
        assert!(g.view(BufferKind::Kv, &[]).is_ok());
        let err = g.view(BufferKind::CsaKv, &read).unwrap_err();
        assert!(
            matches!(cause(err.clone()), Error::Unwritten { kind: "csa_kv", .. }),
            "{err:?}"
        );
        // A layer without the pool refuses to name it.
        drop(g);
        let g0 = step.wait_layer(0).unwrap();
        assert!(matches!(
            g0.view(BufferKind::CsaKv, &[]),
            Err(Error::InvalidArgument { .. })
        ));
    }
    assert_eq!(prefix.tokens, 0);
    c.abort(1).unwrap();
    c.leak_check().unwrap();
}

/// A cache whose prompt `a` (3 full pages + a partial one) was computed, then evicted to
/// the host tier, under `faults` and `verify`.
fn host_only(faults: &[Fault], verify: bool) -> (HiCache<CpuBackend>, Expect, Vec<u32>) {
    let mut cfg = CacheConfig::new(6, 16);
    cfg.faults = Faults::with(faults);
    cfg.verify = verify;
    cfg.wait_timeout = Duration::from_secs(2);
    let c = cache(v4_spec(KvDtype::Model1Fp8, IndexKDtype::Fp4E2m1), cfg);
    let e = Expect::default();
    let a = prompt(7, 3 * TPP + 3);
    assert_eq!(e.request(&c, 1, &a, &[]).unwrap(), 0);
    // Another prompt in the freed device pages, so stale device bytes are not `a`'s.
    c.evict_device(4).unwrap();
    e.request(&c, 2, &prompt(8, 4 * TPP), &[]).unwrap();
    c.evict_device(4).unwrap();
    (c, e, a)
}

/// Runs `a` again and returns the error it met (the test fails if it was served).
fn reload_error(faults: &[Fault], verify: bool) -> Error {
    let (c, e, a) = host_only(faults, verify);
    let err = cause(e.request(&c, 3, &a, &[]).unwrap_err());
    c.leak_check().unwrap();
    err
}

/// `host-tier-skips-index-k` (SGLang 17085): caught by the load checksums of every pool
/// and, independently, by the host copy's record of the pools it holds; with both off
/// the stale index keys are served.
#[test]
fn host_tier_skips_index_k_is_caught_twice_and_real_without_checks() {
    let f = Fault::HostTierSkipsIndexK;
    // Both checks on: the record check runs first.
    let err = reload_error(&[f], true);
    assert!(
        matches!(
            err,
            Error::Integrity {
                what: "host copy (pool never backed up)",
                kind: "index_k",
                ..
            }
        ),
        "{err:?}"
    );
    // Records unchecked: the checksums catch it.
    let err = reload_error(&[f, Fault::NoLandedCheck], true);
    assert!(
        matches!(
            err,
            Error::Integrity {
                what: "host→device",
                kind: "index_k",
                ..
            }
        ),
        "{err:?}"
    );
    // Checksums off: the record check still catches it.
    let err = reload_error(&[f], false);
    assert!(
        matches!(
            err,
            Error::Integrity {
                what: "host copy (pool never backed up)",
                ..
            }
        ),
        "{err:?}"
    );
    // Both off: served corrupted.
    let err = reload_error(&[f, Fault::NoLandedCheck], false);
    assert!(
        matches!(
            err,
            Error::Integrity {
                what: "served page",
                kind: "index_k",
                ..
            }
        ),
        "{err:?}"
    );
}

/// `reload-kv-only` (Mooncake 2236): caught by the load checksums of every pool and,
/// independently, by the per-kind landed stamps; with both off the device page's old
/// index keys are served.
#[test]
fn reload_kv_only_is_caught_twice_and_real_without_checks() {
    let f = Fault::ReloadKvOnly;
    let err = reload_error(&[f], true);
    assert!(
        matches!(
            err,
            Error::Integrity {
                what: "host→device",
                kind: "index_k",
                ..
            }
        ),
        "{err:?}"
    );
    let err = reload_error(&[f], false);
    assert!(
        matches!(
            err,
            Error::NotLanded {
                kind: "index_k",
                ..
            }
        ),
        "{err:?}"
    );
    let err = reload_error(&[f, Fault::NoLandedCheck], false);
    assert!(
        matches!(
            err,
            Error::Integrity {
                what: "served page",
                kind: "index_k",
                ..
            }
        ),
        "{err:?}"
    );
}

/// `pool-page-size-mismatch`: the compressed pools' host pages sized with the window's
/// page size are refused by the descriptor comparison; with that bypassed
/// (`no-layout-check`) the misplaced copies (which overwrite other pools' host pages) are
/// caught by the load checksums; with both off wrong bytes are served.
#[test]
fn pool_page_size_mismatch_is_caught_twice_and_real_without_checks() {
    let f = Fault::PoolPageSizeMismatch;
    // The backups themselves are refused: nothing reaches the host tier, and the evicted
    // pages that could not be backed up leave the cache (recomputed, never misread).
    let mut cfg = CacheConfig::new(6, 16);
    cfg.faults = Faults::with(&[f]);
    let c = cache(v4_spec(KvDtype::Model1Fp8, IndexKDtype::Fp4E2m1), cfg);
    let e = Expect::default();
    let a = prompt(7, 3 * TPP + 3);
    assert_eq!(e.request(&c, 1, &a, &[]).unwrap(), 0);
    let err = c.evict_device(4).unwrap_err();
    assert!(matches!(err, Error::LayoutMismatch { .. }), "{err:?}");
    let s = c.leak_check().unwrap();
    assert!(s.backup_failures > 0 && s.host_cached == 0, "{s:?}");
    assert_eq!(e.request(&c, 3, &a, &[]).unwrap(), 0, "recomputed");
    let err = reload_error(&[f, Fault::NoLayoutCheck], true);
    assert!(
        // The misplaced compressed pages land on other pools' host pages: which pool's
        // check fails first depends on the order of the copies.
        matches!(
            err,
            Error::Integrity {
                what: "host→device",
                ..
            }
        ),
        "{err:?}"
    );
    let err = reload_error(&[f, Fault::NoLayoutCheck], false);
    assert!(
        matches!(
            err,
            Error::Integrity {
                what: "served page",
                ..
            }
        ),
        "{err:?}"
    );
}

/// `compressor-state-lost` (DeepSeek-V4: a prefix reused without its compressor state):
/// caught by the host copy's record of its pools and, with the records unchecked, by the
/// load checksums; with both off the stale state rows are served.
#[test]
fn compressor_state_lost_is_caught_twice_and_real_without_checks() {
    let f = Fault::CompressorStateLost;
    let err = reload_error(&[f], true);
    assert!(
        matches!(
            err,
            Error::Integrity {
                what: "host copy (pool never backed up)",
                kind: "state",
                ..
            }
        ),
        "{err:?}"
    );
    let err = reload_error(&[f, Fault::NoLandedCheck], true);
    assert!(
        matches!(
            err,
            Error::Integrity {
                what: "host→device",
                kind: "state",
                ..
            }
        ),
        "{err:?}"
    );
    let err = reload_error(&[f, Fault::NoLandedCheck], false);
    assert!(
        matches!(
            err,
            Error::Integrity {
                what: "served page",
                kind: "state",
                ..
            }
        ),
        "{err:?}"
    );
}
