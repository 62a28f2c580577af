//! Issue 7 regression tests written against the OLD cache API, to show each defect is real
//! before the redesign. Each test is bounded (threads + recv_timeout), none sleeps as sync.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use common::{spec, Expect, Sim, LAYERS, PAGE};
use sparsekit_host::cache::{BufferKind, CacheConfig, Fault, Faults, HiCache, HostLayout, LayerFence};
use sparsekit_host::layout::{IndexKDtype, KvDtype};
use sparsekit_host::ops::*;
use sparsekit_host::{Backend, CpuBackend, Result};

fn prompt(base: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| base * 1000 + i).collect()
}

#[derive(Debug, Default)]
struct Panicky {
    inner: CpuBackend,
    panic_copies: AtomicBool,
}
impl Backend for Panicky {
    type Buffer = <CpuBackend as Backend>::Buffer;
    fn name(&self) -> &str { "panicky" }
    fn supports(&self, op: Op) -> bool { self.inner.supports(op) }
    fn upload(&self, b: &[u8]) -> Result<Self::Buffer> { self.inner.upload(b) }
    fn alloc(&self, n: usize) -> Result<Self::Buffer> { self.inner.alloc(n) }
    fn alloc_host(&self, n: usize) -> Result<Self::Buffer> { self.inner.alloc_host(n) }
    fn download(&self, b: &Self::Buffer) -> Result<Vec<u8>> { self.inner.download(b) }
    fn buffer_len(&self, b: &Self::Buffer) -> usize { self.inner.buffer_len(b) }
    fn index_k_store(&self, op: &IndexKStore<'_>, k: &Self::Buffer, c: &mut Self::Buffer) -> Result<()> { self.inner.index_k_store(op, k, c) }
    fn kv_store(&self, op: &KvStore<'_>, k: &Self::Buffer, c: &mut Self::Buffer) -> Result<()> { self.inner.kv_store(op, k, c) }
    fn indexer_logits(&self, op: &IndexerLogits<'_>, q: &Self::Buffer, w: &Self::Buffer, c: &Self::Buffer, o: &mut Self::Buffer) -> Result<()> { self.inner.indexer_logits(op, q, w, c, o) }
    fn topk(&self, op: &Topk<'_>, l: &Self::Buffer, o: &mut Self::Buffer) -> Result<()> { self.inner.topk(op, l, o) }
    fn sparse_mla(&self, op: &SparseMla, q: &Self::Buffer, c: &Self::Buffer, i: &Self::Buffer, o: &mut Self::Buffer, l: &mut Self::Buffer) -> Result<()> { self.inner.sparse_mla(op, q, c, i, o, l) }
    fn copy_pages(&self, op: &CopyPages<'_>, s: &Self::Buffer, d: &mut Self::Buffer) -> Result<()> {
        if self.panic_copies.load(Ordering::SeqCst) { panic!("injected io panic"); }
        self.inner.copy_pages(op, s, d)
    }
    fn page_checksums(&self, op: &PageChecksums<'_>, p: &Self::Buffer, o: &mut Self::Buffer) -> Result<()> { self.inner.page_checksums(op, p, o) }
}

fn bounded<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || { let _ = tx.send(f()); });
    rx.recv_timeout(Duration::from_secs(3)).ok()
}

/// Defect 1: a second begin on an in-flight load gets a complete fence and reads unloaded bytes.
#[test]
fn d1_second_request_on_inflight_load_reads_unloaded_bytes() {
    let mut cfg = CacheConfig::new(4, 8);
    cfg.io_delay = Duration::from_millis(300);
    let c = common::cache(spec(KvDtype::Bf16, IndexKDtype::Bf16), cfg);
    let mut e = Expect::default();
    let a = prompt(1, 2 * PAGE);
    e.request(&c, 1, &a, false).unwrap();
    c.evict_device(2).unwrap();
    e.request(&c, 9, &prompt(9, 2 * PAGE), true).unwrap();
    let _p1 = c.begin(2, &a).unwrap();
    // Request 3 matches the same prefix while it loads; its reads must see the committed bytes.
    assert_eq!(e.request(&c, 3, &a, false).unwrap(), 2 * PAGE, "request 3 was served the committed bytes");
}

/// Defect 2: a failed load frees pages that a live request holds.
#[test]
fn d2_failed_load_frees_pages_of_a_live_request() {
    let mut cfg = CacheConfig::new(6, 8);
    cfg.io_delay = Duration::from_millis(200);
    let c = common::cache(spec(KvDtype::Bf16, IndexKDtype::Bf16), cfg);
    let mut e = Expect::default();
    let a = prompt(1, 2 * PAGE);
    e.request(&c, 1, &a, false).unwrap();
    c.evict_device(2).unwrap();
    {   // corrupt host copies so the load fails
        let host = c.host().unwrap();
        let region = host.region(0, BufferKind::Kv);
        let mut buf = host.write().unwrap();
        let mut bytes = c.backend().download(&buf).unwrap();
        for p in 0..host.num_pages() { bytes[region.page_range(p).start + 3] ^= 1; }
        *buf = c.backend().upload(&bytes).unwrap();
    }
    let _p2 = c.begin(2, &a).unwrap();
    // Request 3 extends the prefix and commits a page below it, then stays live.
    let mut long = a.clone();
    long.extend(prompt(3, PAGE));
    let p3 = c.begin(3, &long).unwrap();
    let own = c.alloc(3, 1).unwrap();
    let mut pages = p3.pages.clone();
    pages.extend(&own);
    c.commit(3, &long, &pages).unwrap();
    let _ = p3.loads.wait_all();
    let _ = _p2.loads.wait_all(); // load fails
    c.begin(4, &[]).unwrap();
    let free = c.stats().unwrap().device_free;
    let got = c.alloc(4, free).unwrap_or_default();
    assert!(!got.iter().any(|p| p.id == own[0].id), "request 4 got page {} that live request 3 still holds", own[0].id);
}

/// Defect 3: a panicking io worker wedges waiters.
#[test]
fn d3_io_panic_fails_waiters_within_a_bound() {
    let b = Arc::new(Panicky::default());
    let c = Arc::new(HiCache::new(b.clone(), spec(KvDtype::Bf16, IndexKDtype::Bf16), CacheConfig::new(4, 8)).unwrap());
    let mut e = Expect::default();
    let a = prompt(1, 2 * PAGE);
    e.request(&*c, 1, &a, false).unwrap();
    c.evict_device(2).unwrap();
    b.panic_copies.store(true, Ordering::SeqCst);
    let p = c.begin(2, &a).unwrap();
    let r = bounded(move || p.loads.wait_all().is_err());
    assert_eq!(r, Some(true), "waiter must get an error within the bound");
}

/// Defect 4: KV + index-K views of one layer deadlock against the io worker.
#[test]
fn d4_both_views_of_a_layer_do_not_deadlock_against_the_io_worker() {
    let mut cfg = CacheConfig::new(4, 8);
    cfg.io_delay = Duration::from_millis(50);
    let c = Arc::new(common::cache(spec(KvDtype::Bf16, IndexKDtype::Bf16), cfg));
    let mut e = Expect::default();
    let a = prompt(1, 2 * PAGE);
    e.request(&*c, 1, &a, false).unwrap();
    c.evict_device(2).unwrap();
    let c2 = c.clone();
    let r = bounded(move || {
        let f = LayerFence::complete(LAYERS);
        let t = f.wait(0).unwrap();
        let kv = c2.device().kv(&t).unwrap();
        let _p = c2.begin(5, &a).unwrap(); // the io worker now wants layer 0 for writing
        std::thread::sleep(Duration::from_millis(200));
        let ik = c2.device().index_k(&t).unwrap();
        drop((kv, ik));
    });
    assert!(r.is_some(), "deadlock: KV view held, worker waits to write, index-K view blocks");
}

/// Defect 5: a ready token can be forged for a layer that is still loading.
#[test]
fn d5_forged_token_reads_mid_load() {
    let mut cfg = CacheConfig::new(4, 8);
    cfg.io_delay = Duration::from_millis(300);
    let c = common::cache(spec(KvDtype::Bf16, IndexKDtype::Bf16), cfg);
    let mut e = Expect::default();
    let a = prompt(1, 2 * PAGE);
    e.request(&c, 1, &a, false).unwrap();
    c.evict_device(2).unwrap();
    e.request(&c, 9, &prompt(9, 2 * PAGE), true).unwrap();
    let p = c.begin(2, &a).unwrap();
    let forged = sparsekit_host::cache::LoadGroup::new(vec![], LAYERS);
    let t = forged.wait(LAYERS - 1).unwrap();
    let early = c.backend().download(c.device().index_k(&t).unwrap().buffer()).unwrap();
    let sim = Sim { cache: &c };
    let late = sim.read(&p, LAYERS - 1, BufferKind::IndexK, p.pages[0]).unwrap();
    let r = c.device().region(BufferKind::IndexK).page_range(p.pages[0].id as usize);
    assert_eq!(early[r].to_vec(), late, "a token obtained without the load read unlanded bytes");
}

/// Defect 6: commit accepts the same page twice.
#[test]
fn d6_commit_rejects_duplicate_pages() {
    let c = common::cache(spec(KvDtype::Bf16, IndexKDtype::Bf16), CacheConfig::new(4, 0));
    c.begin(1, &[]).unwrap();
    let p = c.alloc(1, 2).unwrap();
    let r = c.commit(1, &prompt(1, 2 * PAGE), &[p[0], p[0]]);
    assert!(r.is_err(), "duplicate page accepted");
    c.finish(1).unwrap();
    c.leak_check().unwrap();
}

/// Defect 7: backup leaks host pages when its copy fails.
#[test]
fn d7_failed_backup_frees_its_host_pages() {
    let mut cfg = CacheConfig::new(4, 8);
    cfg.faults = Faults::with(&[Fault::HostPoolFp8Layout]);
    let c = common::cache(spec(KvDtype::Bf16, IndexKDtype::Bf16), cfg);
    let mut e = Expect::default();
    e.request(&c, 1, &prompt(1, 3 * PAGE), false).unwrap();
    assert!(c.evict_device(3).is_err());
    c.leak_check().unwrap();
}

/// Defect 8: shared-item-size is a no-op in the LayerFirst host layout.
#[test]
fn d8_shared_item_size_bites_in_layer_first() {
    let mut cfg = CacheConfig::new(4, 8);
    cfg.host_layout = HostLayout::LayerFirst;
    cfg.faults = Faults::with(&[Fault::SharedItemSize]);
    let c = common::cache(spec(KvDtype::Fp8DsMla, IndexKDtype::Bf16), cfg);
    let mut e = Expect::default();
    let a = prompt(1, 3 * PAGE);
    e.request(&c, 1, &a, false).unwrap();
    let r = c.evict_device(3).and_then(|_| e.request(&c, 2, &a, false));
    assert!(r.is_err(), "the fault must corrupt (and be caught) in LayerFirst too");
}

/// Defect 9a: abort does not cancel a queued load.
#[test]
fn d9_abort_cancels_the_queued_load() {
    let mut cfg = CacheConfig::new(4, 8);
    cfg.io_delay = Duration::from_millis(100);
    let c = common::cache(spec(KvDtype::Bf16, IndexKDtype::Bf16), cfg);
    let mut e = Expect::default();
    let a = prompt(1, 2 * PAGE);
    e.request(&c, 1, &a, false).unwrap();
    c.evict_device(2).unwrap();
    let p = c.begin(2, &a).unwrap();
    c.abort(2).unwrap();
    assert!(p.loads.wait_all().is_err(), "the aborted request's load ran to completion");
}

/// Defect 9b: backups copy under the state mutex: begin waits behind them.
#[test]
fn d9_backups_do_not_block_begin() {
    let mut cfg = CacheConfig::new(4, 8);
    cfg.io_delay = Duration::ZERO;
    let b = Arc::new(Slow::default());
    let c = Arc::new(HiCache::new(b.clone(), spec(KvDtype::Bf16, IndexKDtype::Bf16), cfg).unwrap());
    let mut e = Expect::default();
    e.request(&*c, 1, &prompt(1, 3 * PAGE), false).unwrap();
    b.slow.store(true, Ordering::SeqCst);
    let c2 = c.clone();
    std::thread::spawn(move || { let _ = c2.evict_device(3); });
    while b.entered.load(Ordering::SeqCst) == false { std::thread::yield_now(); }
    let c3 = c.clone();
    let r = bounded(move || c3.stats().is_ok());
    b.slow.store(false, Ordering::SeqCst);
    assert_eq!(r, Some(true), "stats blocked behind a backup copy");
}

#[derive(Debug, Default)]
struct Slow { inner: CpuBackend, slow: AtomicBool, entered: AtomicBool }
impl Backend for Slow {
    type Buffer = <CpuBackend as Backend>::Buffer;
    fn name(&self) -> &str { "slow" }
    fn supports(&self, op: Op) -> bool { self.inner.supports(op) }
    fn upload(&self, b: &[u8]) -> Result<Self::Buffer> { self.inner.upload(b) }
    fn alloc(&self, n: usize) -> Result<Self::Buffer> { self.inner.alloc(n) }
    fn alloc_host(&self, n: usize) -> Result<Self::Buffer> { self.inner.alloc_host(n) }
    fn download(&self, b: &Self::Buffer) -> Result<Vec<u8>> { self.inner.download(b) }
    fn buffer_len(&self, b: &Self::Buffer) -> usize { self.inner.buffer_len(b) }
    fn index_k_store(&self, op: &IndexKStore<'_>, k: &Self::Buffer, c: &mut Self::Buffer) -> Result<()> { self.inner.index_k_store(op, k, c) }
    fn kv_store(&self, op: &KvStore<'_>, k: &Self::Buffer, c: &mut Self::Buffer) -> Result<()> { self.inner.kv_store(op, k, c) }
    fn indexer_logits(&self, op: &IndexerLogits<'_>, q: &Self::Buffer, w: &Self::Buffer, c: &Self::Buffer, o: &mut Self::Buffer) -> Result<()> { self.inner.indexer_logits(op, q, w, c, o) }
    fn topk(&self, op: &Topk<'_>, l: &Self::Buffer, o: &mut Self::Buffer) -> Result<()> { self.inner.topk(op, l, o) }
    fn sparse_mla(&self, op: &SparseMla, q: &Self::Buffer, c: &Self::Buffer, i: &Self::Buffer, o: &mut Self::Buffer, l: &mut Self::Buffer) -> Result<()> { self.inner.sparse_mla(op, q, c, i, o, l) }
    fn copy_pages(&self, op: &CopyPages<'_>, s: &Self::Buffer, d: &mut Self::Buffer) -> Result<()> {
        if self.slow.load(Ordering::SeqCst) {
            self.entered.store(true, Ordering::SeqCst);
            let t0 = std::time::Instant::now();
            while self.slow.load(Ordering::SeqCst) && t0.elapsed() < Duration::from_secs(6) { std::thread::yield_now(); }
        }
        self.inner.copy_pages(op, s, d)
    }
    fn page_checksums(&self, op: &PageChecksums<'_>, p: &Self::Buffer, o: &mut Self::Buffer) -> Result<()> { self.inner.page_checksums(op, p, o) }
}
