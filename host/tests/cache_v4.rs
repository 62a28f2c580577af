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

use crate::common;

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
        let ids: Vec<i32> = pages.iter().map(|p| p.id as i32).collect();
        // A page whose window rows were given back reads as empty in that pool.
        for (i, at) in g.buffer_pages(kind, &ids).into_iter().enumerate() {
            if let Ok(at) = usize::try_from(at) {
                out[i][kind.index()] = bytes[r.page_range(at)].to_vec();
            }
        }
    }
    Ok(out)
}

/// Page `i` of layer `l` served other bytes of pool `k` than first computed.
fn served_wrong(i: usize, l: usize, k: BufferKind) -> Error {
    Error::Integrity {
        what: "served page",
        page: i as u32,
        layer: l,
        kind: k.name(),
        expected: 0,
        actual: 1,
    }
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
                Some(k) => Err(served_wrong(i, l, k)),
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

/// The window spec: V4's pools with the KV pool a window of 1.5 pages.
const WINDOW: usize = TPP + TPP / 2;

fn window_spec() -> CacheSpec {
    v4_spec(KvDtype::Model1Fp8, IndexKDtype::FP8)
        .with_window(WINDOW)
        .unwrap()
}

/// One sequence grown token by token as a decode would: a prompt computed in one step,
/// then one token a step, each step storing the new token's entries of every pool and
/// reading every page it holds (the window's rows must be those first computed), and,
/// from `release_from` pages on, giving back the window rows its tokens left.
struct Grown {
    pages: Vec<PageRef>,
    tokens: usize,
}

fn grow(
    c: &HiCache<CpuBackend>,
    e: &Expect,
    req: u64,
    all: &[u32],
    prefix: &Prefix,
    prompt_len: usize,
    release_from: Option<usize>,
) -> Result<Grown> {
    let spec = *c.spec();
    let mut g = Grown {
        pages: prefix.pages.clone(),
        tokens: prefix.tokens,
    };
    let mut next = prompt_len;
    while g.tokens < all.len() {
        let upto = next.min(all.len());
        let need = upto.div_ceil(TPP).saturating_sub(g.pages.len());
        g.pages.extend(c.alloc(req, need)?);
        {
            let mut step = c.step(&[req])?;
            for l in 0..spec.num_layers {
                let mut guard = step.wait_layer(l)?;
                store_layer(
                    &mut guard,
                    c.backend(),
                    &spec,
                    &all[..upto],
                    &g.pages,
                    g.tokens,
                    &[],
                )?;
                let full = upto / TPP;
                for (i, got) in read_pages(c, &guard, &g.pages[..full])?
                    .into_iter()
                    .enumerate()
                {
                    e.check_present(&all[..upto], i, l, got)?;
                }
            }
        }
        g.tokens = upto;
        next = upto + 1;
        if let Some(from) = release_from {
            c.release_window(req, &g.pages, from, g.tokens)?;
        }
    }
    Ok(g)
}

impl Expect {
    /// [`Expect::check_or_learn`] of the pools a page still holds (a page whose window
    /// rows were given back is checked in its other pools).
    fn check_present(&self, tokens: &[u32], i: usize, l: usize, got: Vec<Vec<u8>>) -> Result<()> {
        let key = (prefix_hash(&tokens[..(i + 1) * TPP]), l);
        let mut map = self.pages.lock().unwrap();
        let want = map.entry(key).or_insert_with(|| got.clone());
        for k in BufferKind::ALL {
            let (w, g) = (&want[k.index()], &got[k.index()]);
            if w.is_empty() && !g.is_empty() {
                want[k.index()] = g.clone();
            } else if !g.is_empty() && w != g {
                return Err(served_wrong(i, l, k));
            }
        }
        Ok(())
    }
}

/// A decode longer than the window pool's frames runs because the pages its tokens left
/// give their window rows back; the rows still read are the ones first computed; a page
/// that gave them back takes no store and no read of its window; the prefix it commits
/// ends, for a later request, on a page that holds its window rows.
#[test]
fn a_decode_gives_back_the_window_rows_its_tokens_left() {
    let spec = window_spec();
    assert_eq!(spec.window(), Some(WINDOW));
    assert!(spec.windowed(BufferKind::Kv) && !spec.windowed(BufferKind::CsaKv));
    assert_ne!(
        spec.fingerprint(),
        v4_spec(KvDtype::Model1Fp8, IndexKDtype::FP8).fingerprint()
    );
    assert!(
        CacheSpec::new(
            KvLayout::new(KvDtype::Bf16, 512, 64, 16).unwrap(),
            IndexKLayout::new(IndexKDtype::FP8, 128, 16).unwrap(),
            2
        )
        .unwrap()
        .with_window(128)
        .is_err(),
        "V3.2 reads every token's KV"
    );
    // 6 frames: the prompt's 3 pages, the window's 2 and the page being filled.
    let mut cfg = CacheConfig::new(12, 0);
    cfg.window_pages = Some(6);
    let c = cache(spec, cfg.clone());
    let e = Expect::default();
    let all = prompt(1, 8 * TPP + 3);
    let prompt_len = 2 * TPP + 5;

    // Without giving rows back, 9 pages do not fit in 6 frames.
    let p = c.begin(1, &all).unwrap();
    let err = grow(&c, &e, 1, &all, &p, prompt_len, None).err().unwrap();
    assert!(
        matches!(
            err,
            Error::OutOfPages {
                what: "window frames",
                ..
            }
        ),
        "{err:?}"
    );
    c.abort(1).unwrap();

    // Giving them back from the first page past the prompt: it runs to the end.
    let p = c.begin(2, &all).unwrap();
    assert_eq!(p.tokens, 0);
    let first_own = prompt_len.div_ceil(TPP);
    let g = grow(&c, &e, 2, &all, &p, prompt_len, Some(first_own)).unwrap();
    let s = c.stats();
    // Pages 3..=5 left the window (6 and 7 are the last full pages, 8 the partial one).
    assert_eq!(spec.window_passed(g.tokens), 6);
    assert_eq!(
        (s.window_frames, s.window_frames_free, s.window_released),
        (6, 0, 3),
        "{s:?}"
    );
    {
        let mut step = c.step(&[2]).unwrap();
        let mut guard = step.wait_layer(0).unwrap();
        // No store into a page's window rows once given back...
        let r = guard.kv_store(
            &[SlotRef {
                page: g.pages[4],
                offset: 0,
            }],
            &c.backend()
                .upload(bytemuck::cast_slice(&values(7, 512)))
                .unwrap(),
        );
        assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
        // ...and no read that still needs them: the window of the first 5 pages' tokens.
        let read = |tokens| {
            guard
                .view(
                    BufferKind::Kv,
                    &[ReadExtent {
                        request: 2,
                        pages: &g.pages,
                        tokens,
                    }],
                )
                .map(|_| ())
        };
        assert!(matches!(
            read(5 * TPP).map_err(cause),
            Err(Error::Unwritten { .. })
        ));
        read(g.tokens).unwrap();
        let id = g.pages[4].id as i32;
        assert_eq!(guard.buffer_pages(BufferKind::Kv, &[id, -1]), [-1, -1]);
        assert_eq!(guard.buffer_pages(BufferKind::CsaKv, &[id]), [id]);
    }
    c.commit(2, &all, &g.pages).unwrap();
    c.finish(2).unwrap();
    c.leak_check().unwrap();

    // A request extending the whole sequence hits all 8 full pages (the last holds its
    // window rows)...
    let mut longer = all.clone();
    longer.extend(prompt(4, 3));
    let p = c.begin(4, &longer).unwrap();
    assert_eq!(p.tokens, 8 * TPP);
    grow(&c, &e, 4, &longer, &p, longer.len(), None).unwrap();
    c.abort(4).unwrap();
    c.leak_check().unwrap();
    // ...one sharing 5 pages ends its hit on the deepest one that does (the prompt's
    // last), and the frames it needs come from cached pages (which stay cached).
    let before = c.stats();
    let mut other = all[..5 * TPP].to_vec();
    other.extend(prompt(3, TPP));
    assert_eq!(c.room(&other).device_pages, 3);
    let p = c.begin(3, &other).unwrap();
    assert_eq!(p.tokens, 3 * TPP);
    grow(&c, &e, 3, &other, &p, other.len(), None).unwrap();
    c.abort(3).unwrap();
    let after = c.leak_check().unwrap();
    assert!(after.window_released > before.window_released, "{after:?}");
    assert_eq!(after.device_cached, before.device_cached, "{after:?}");
    // The long prefix lost the rows of its last pages: its hit ends before them.
    assert!(c.begin(6, &longer).unwrap().tokens < 8 * TPP);
    c.abort(6).unwrap();
    // Pressure that frames alone cannot meet evicts pages as before.
    let fresh = prompt(5, 6 * TPP);
    let p = c.begin(5, &fresh).unwrap();
    grow(&c, &e, 5, &fresh, &p, fresh.len(), None).unwrap();
    c.abort(5).unwrap();
    c.leak_check().unwrap();
}

/// The host tier keeps the window rows a page held when it was backed up; a hit from the
/// host tier ends on a page whose copy has them, and loads its other pages without them.
#[test]
fn the_host_tier_keeps_the_window_rows_a_page_held() {
    let mut cfg = CacheConfig::new(12, 32);
    // 6 frames: the 8-page prefix below loads 5 pages with window rows, 3 without.
    cfg.window_pages = Some(6);
    let c = cache(window_spec(), cfg);
    let e = Expect::default();
    let all = prompt(1, 8 * TPP + 3);
    let prompt_len = 2 * TPP + 5;
    let p = c.begin(1, &all).unwrap();
    let g = grow(&c, &e, 1, &all, &p, prompt_len, Some(3)).unwrap();
    c.commit(1, &all, &g.pages).unwrap();
    c.finish(1).unwrap();
    // Every cached page to the host tier.
    assert_eq!(c.evict_device(8).unwrap(), 8);
    let s = c.leak_check().unwrap();
    assert_eq!((s.device_cached, s.host_cached), (0, 8), "{s:?}");
    let mut longer = all.clone();
    longer.extend(prompt(2, 5));
    let p = c.begin(2, &longer).unwrap();
    assert_eq!((p.tokens, p.loaded_pages), (8 * TPP, 8));
    // Loaded pages without window rows took no frame.
    let s = c.stats();
    assert_eq!(s.window_frames - s.window_frames_free, 5, "{s:?}");
    grow(&c, &e, 2, &longer, &p, longer.len(), None).unwrap();
    c.abort(2).unwrap();
    // A prefix ending inside the pages that gave their rows back ends earlier.
    let p = c.begin(3, &all[..6 * TPP]).unwrap();
    assert_eq!(p.tokens, 3 * TPP);
    c.abort(3).unwrap();
    let s = c.leak_check().unwrap();
    assert_eq!(s.integrity_failures, 0);
}

/// Pages reserved without a frame take one when first stored into (while any is free),
/// the frames a decode gives back go to them first, and a store that finds none free is
/// `OutOfPages`, never a write into another page's rows.
#[test]
fn pages_reserved_without_a_frame_take_one_when_written() {
    let mut cfg = CacheConfig::new(12, 0);
    cfg.window_pages = Some(4);
    let c = cache(window_spec(), cfg);
    let spec = *c.spec();
    let all = prompt(1, 6 * TPP);
    assert_eq!(c.begin(1, &all).unwrap().tokens, 0);
    let pages = c.try_alloc_framed(1, 6, 2).unwrap();
    assert_eq!(c.stats().window_frames_free, 2);
    let store = |upto: usize, from: usize| -> Result<()> {
        let mut step = c.step(&[1])?;
        for l in 0..spec.num_layers {
            let mut g = step.wait_layer(l)?;
            store_layer(&mut g, c.backend(), &spec, &all[..upto], &pages, from, &[])?;
        }
        Ok(())
    };
    // Pages 0..4 written: 2 framed at reservation, 2 take the free ones.
    store(4 * TPP, 0).unwrap();
    assert_eq!(c.stats().window_frames_free, 0);
    // Page 4 finds no frame free.
    let e = store(5 * TPP, 4 * TPP).map_err(cause).err().unwrap();
    assert!(
        matches!(
            e,
            Error::OutOfPages {
                what: "window frames",
                ..
            }
        ),
        "{e:?}"
    );
    c.abort(1).unwrap();
    let s = c.leak_check().unwrap();
    assert_eq!(s.window_frames_free, 4, "{s:?}");
}

/// Threads decoding at once over shared prefixes with few window frames: frames given
/// back, handed on, taken from cached pages and reloaded from the host tier interleave,
/// and every row any request reads is the one first computed; nothing leaks.
#[test]
fn concurrent_decodes_share_few_frames_without_a_wrong_row() {
    let mut cfg = CacheConfig::new(40, 64);
    cfg.window_pages = Some(24);
    cfg.write_through = true;
    // The requests grow page by page: two can wait for each other's frames (a caller that
    // reserves up front, as the engine does, cannot); a short bound ends that wait.
    cfg.wait_timeout = Duration::from_millis(200);
    let c = cache(window_spec(), cfg);
    let e = Expect::default();
    let system = prompt(9, 3 * TPP);
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (c, e, system) = (&c, &e, &system);
            s.spawn(move || {
                // Four sequences, then the first two again, grown (their pages by now
                // partly in the host tier only).
                for k in [0u64, 1, 2, 3, 4, 5] {
                    let req = 100 * (t + 1) + k;
                    let (seq, again) = (k % 4, k >= 4);
                    // A shared system prompt, a per-thread turn, then a decode.
                    let mut all = system.clone();
                    all.extend(prompt(10 + t as u32, TPP + 7 * seq as usize));
                    all.extend(prompt(50 + (t * 4 + seq) as u32, 3 * TPP + 5));
                    let prompt_len = if again {
                        all.extend(prompt(90 + t as u32, 2));
                        all.len() - 1
                    } else {
                        all.len() - 3 * TPP - 5
                    };
                    if again {
                        all.extend(prompt(95 + t as u32, TPP));
                    }
                    let mut done = false;
                    for _attempt in 0..50 {
                        let p = match c.begin(req, &all) {
                            Ok(p) => p,
                            Err(Error::OutOfPages { .. }) => {
                                std::thread::yield_now();
                                continue;
                            }
                            Err(e) => panic!("begin: {e:?}"),
                        };
                        let from = prompt_len.div_ceil(TPP);
                        match grow(c, e, req, &all, &p, prompt_len, Some(from)) {
                            Ok(g) => {
                                c.commit(req, &all, &g.pages).unwrap();
                                c.finish(req).unwrap();
                                done = true;
                                break;
                            }
                            Err(err) => {
                                c.abort(req).unwrap();
                                match cause(err) {
                                    Error::OutOfPages { .. } | Error::Timeout { .. } => {
                                        std::thread::yield_now()
                                    }
                                    other => panic!("request {req}: {other:?}"),
                                }
                            }
                        }
                    }
                    assert!(done, "request {req} never found room");
                }
            });
        }
    });
    c.wait_idle().unwrap();
    let s = c.leak_check().unwrap();
    assert_eq!((s.integrity_failures, s.live_requests), (0, 0), "{s:?}");
    assert!(s.window_released > 0 && s.hits_host_pages > 0, "{s:?}");
    // With nothing live, a frame in use is a cached page's.
    assert!(
        s.window_frames - s.window_frames_free <= s.device_cached,
        "{s:?}"
    );
}
