//! The hierarchical cache on the CPU backend: round trips through the host tier, integrity
//! checks, fences, generations, accounting, and one test per fault injection showing the
//! check that catches it (and that, without the check, the corruption is real).

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

mod common;

use std::time::Duration;

use common::{cache, cache_on, spec, Expect, Sim, LAYERS, PAGE};
use sparsekit_host::cache::{BufferKind, CacheConfig, Fault, Faults, HostLayout};
use sparsekit_host::layout::{IndexKDtype, KvDtype};
use sparsekit_host::ops::PagedRegion;
use sparsekit_host::{Backend, EmuBackend, Error};

fn prompt(base: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| base * 1000 + i).collect()
}

#[test]
fn prefix_reuse_through_the_host_tier_is_bit_exact() {
    for kv in [KvDtype::Bf16, KvDtype::Fp8DsMla] {
        for ik in [IndexKDtype::FP8, IndexKDtype::Bf16] {
            for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
                let mut cfg = CacheConfig::new(6, 16);
                cfg.host_layout = layout;
                let c = cache(spec(kv, ik), cfg);
                let mut e = Expect::default();
                let a = prompt(1, 4 * PAGE + 2);
                assert_eq!(e.request(&c, 1, &a, false).unwrap(), 0);
                // A different prompt fills the device and pushes `a` to the host tier.
                assert_eq!(e.request(&c, 2, &prompt(2, 5 * PAGE), false).unwrap(), 0);
                let s = c.leak_check().unwrap();
                assert!(s.backups > 0 && s.host_cached > 0, "{s:?}");
                // `a` again: its 4 full pages come back from the host, verified.
                assert_eq!(e.request(&c, 3, &a, false).unwrap(), 4 * PAGE);
                let s = c.leak_check().unwrap();
                // LRU evicts leaves first: the root-side page may stay on the device.
                assert_eq!(s.hits_host_pages + s.hits_device_pages, 4, "{s:?}");
                assert!(s.hits_host_pages >= 3, "{s:?}");
                assert!(e.hits_checked >= 4 * LAYERS * 2);
                assert_eq!(s.device_in_use, 0);
            }
        }
    }
}

#[test]
fn a_corrupted_host_page_fails_the_load_and_is_dropped() {
    let c = cache(
        spec(KvDtype::Fp8DsMla, IndexKDtype::Bf16),
        CacheConfig::new(4, 8),
    );
    let mut e = Expect::default();
    let a = prompt(1, 3 * PAGE);
    e.request(&c, 1, &a, false).unwrap();
    c.evict_device(3).unwrap();
    assert_eq!(c.stats().unwrap().host_cached, 3);
    // Flip one byte of layer 1's index-K in every host page.
    {
        let host = c.host().unwrap();
        let region = host.region(1, BufferKind::IndexK);
        let mut buf = host.write().unwrap();
        let mut bytes = c.backend().download(&buf).unwrap();
        for p in 0..host.num_pages() {
            bytes[region.page_range(p).start + 7] ^= 0x10;
        }
        *buf = c.backend().upload(&bytes).unwrap();
    }
    let err = e.request(&c, 2, &a, false).unwrap_err();
    assert!(matches!(err, Error::Integrity { layer: 1, .. }), "{err:?}");
    let s = c.leak_check().unwrap();
    assert_eq!(s.integrity_failures, 1);
    assert_eq!(s.host_cached, 0, "failed pages are dropped, never served");
    // Recomputed from scratch afterwards.
    assert_eq!(e.request(&c, 3, &a, false).unwrap(), 0);
    c.leak_check().unwrap();
}

#[test]
fn verification_can_be_turned_off_for_benchmarks() {
    let mut cfg = CacheConfig::new(4, 8);
    cfg.verify = false;
    let c = cache(spec(KvDtype::Bf16, IndexKDtype::Bf16), cfg);
    let mut e = Expect::default();
    let a = prompt(1, 3 * PAGE);
    e.request(&c, 1, &a, false).unwrap();
    c.evict_device(3).unwrap();
    assert_eq!(e.request(&c, 2, &a, false).unwrap(), 3 * PAGE);
    c.leak_check().unwrap();
}

/// `host-pool-fp8-layout`: the mirror's index-K rows are sized fp8 under a bf16 device.
/// The descriptor check on every copy refuses the mismatch; without it the device rows
/// (256 B/token here 64 B) would not even fit the host rows.
#[test]
fn fault_host_pool_fp8_layout_is_refused_by_the_descriptor_check() {
    let mut cfg = CacheConfig::new(4, 8);
    cfg.faults = Faults::with(&[Fault::HostPoolFp8Layout]);
    let c = cache(spec(KvDtype::Bf16, IndexKDtype::Bf16), cfg);
    let host_row = c
        .host()
        .unwrap()
        .region(0, BufferKind::IndexK)
        .layout
        .bytes_per_page();
    let dev_row = c
        .device()
        .region(BufferKind::IndexK)
        .layout
        .bytes_per_page();
    assert!(host_row < dev_row, "the fault really shrinks the host rows");
    let mut e = Expect::default();
    e.request(&c, 1, &prompt(1, 3 * PAGE), false).unwrap();
    let err = c.evict_device(3).unwrap_err();
    assert!(matches!(err, Error::LayoutMismatch { .. }), "{err:?}");
    // Without the fault the same sequence works.
    let c = cache(
        spec(KvDtype::Bf16, IndexKDtype::Bf16),
        CacheConfig::new(4, 8),
    );
    Expect::default()
        .request(&c, 1, &prompt(1, 3 * PAGE), false)
        .unwrap();
    assert_eq!(c.evict_device(3).unwrap(), 3);
}

/// `skip-index-wait`: reading index-K without the ready token during a slow load sees
/// bytes that have not landed; the fenced read of the same layer sees the right ones.
#[test]
fn fault_skip_index_wait_reads_unlanded_bytes_and_the_fence_prevents_it() {
    let mut cfg = CacheConfig::new(4, 8);
    cfg.io_delay = Duration::from_millis(150);
    cfg.faults = Faults::with(&[Fault::SkipIndexWait]);
    let c = cache(spec(KvDtype::Bf16, IndexKDtype::FP8), cfg);
    let mut e = Expect::default();
    let a = prompt(1, 2 * PAGE);
    e.request(&c, 1, &a, false).unwrap();
    c.evict_device(2).unwrap();
    // Another request leaves its own bytes in the freed device pages.
    e.request(&c, 9, &prompt(9, 2 * PAGE), true).unwrap();
    let prefix = c.begin(2, &a).unwrap();
    assert_eq!(prefix.loaded_pages, 2);
    let sim = Sim { cache: &c };
    let page = prefix.pages[0];
    let faults = Faults::with(&[Fault::SkipIndexWait]);
    let unfenced = {
        let view = c.device().index_k_unfenced(LAYERS - 1, &faults).unwrap();
        c.backend().download(view.buffer()).unwrap()[c
            .device()
            .region(BufferKind::IndexK)
            .page_range(page.id as usize)]
        .to_vec()
    };
    let fenced = sim
        .read(&prefix, LAYERS - 1, BufferKind::IndexK, page)
        .unwrap();
    assert_ne!(
        unfenced, fenced,
        "without the wait the index keys are not there yet"
    );
    // Without the fault there is no unfenced path at all.
    assert!(c.device().index_k_unfenced(0, &Faults::none()).is_err());
    c.finish(2).unwrap();
    // And the fenced path served what was computed.
    assert_eq!(e.request(&c, 3, &a, false).unwrap(), 2 * PAGE);
    c.leak_check().unwrap();
}

/// `shared-item-size`: backing up into a page-first host tier with the device's row
/// geometry scatters pages to the wrong host offsets; load verification catches it, and
/// with verification off the corrupted bytes would be served.
#[test]
fn fault_shared_item_size_is_caught_by_checksums() {
    for verify in [true, false] {
        let mut cfg = CacheConfig::new(4, 8);
        cfg.host_layout = HostLayout::PageFirst;
        cfg.verify = verify;
        cfg.faults = Faults::with(&[Fault::SharedItemSize]);
        let c = cache(spec(KvDtype::Fp8DsMla, IndexKDtype::Bf16), cfg);
        let mut e = Expect::default();
        let a = prompt(1, 3 * PAGE);
        e.request(&c, 1, &a, false).unwrap();
        let backed_up = c.evict_device(3);
        let outcome = backed_up.and_then(|_| e.request(&c, 2, &a, false));
        let err = outcome.unwrap_err();
        if verify {
            assert!(
                matches!(
                    err,
                    Error::Integrity {
                        what: "host→device",
                        ..
                    }
                ),
                "caught by load verification: {err:?}"
            );
        } else {
            // Verification off: the corrupted bytes reach the reader (the test's own
            // comparison of served pages fails).
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
    }
}

/// `no-generation-check`: a late write for an aborted request's page lands in the page
/// now owned by another request unless generations are checked.
#[test]
fn fault_no_generation_check_lets_stale_writes_corrupt_a_reused_page() {
    for fault in [false, true] {
        let mut cfg = CacheConfig::new(4, 8);
        if fault {
            cfg.faults = Faults::with(&[Fault::NoGenerationCheck]);
        }
        let c = cache(spec(KvDtype::Bf16, IndexKDtype::Bf16), cfg);
        c.begin(1, &[]).unwrap();
        let stale = c.alloc(1, 1).unwrap()[0];
        c.abort(1).unwrap();
        // Request 2 gets the same page and writes its data.
        c.begin(2, &[]).unwrap();
        let fresh = c.alloc(2, 1).unwrap()[0];
        assert_eq!(fresh.id, stale.id);
        assert_ne!(fresh.generation, stale.generation);
        let sim = Sim { cache: &c };
        let toks = prompt(2, PAGE);
        sim.write(&toks, &[fresh], 0).unwrap();
        let before = c.backend().download(&c.layer_mut(0).unwrap().kv).unwrap();
        // The late frame for request 1.
        let kv_layout = c.spec().kv;
        let src = c
            .backend()
            .upload(&vec![0xEE; kv_layout.bytes_per_page()])
            .unwrap();
        let res = c.write_pages(
            0,
            BufferKind::Kv,
            &[stale],
            &src,
            PagedRegion::contiguous(kv_layout, 1),
            &[0],
        );
        let after = c.backend().download(&c.layer_mut(0).unwrap().kv).unwrap();
        if fault {
            assert!(res.is_ok());
            assert_ne!(before, after, "the stale write corrupted request 2's page");
        } else {
            assert!(matches!(res, Err(Error::StalePage { .. })), "{res:?}");
            assert_eq!(before, after, "request 2's page is intact");
            assert_eq!(c.stats().unwrap().stale_writes_refused, 1);
        }
        c.finish(2).unwrap();
        c.leak_check().unwrap();
    }
}

#[test]
fn accounting_and_errors() {
    let c = cache(
        spec(KvDtype::Bf16, IndexKDtype::Bf16),
        CacheConfig::new(4, 0),
    );
    c.begin(1, &[]).unwrap();
    assert!(
        matches!(c.begin(1, &[]), Err(Error::InvalidArgument { .. })),
        "request already live"
    );
    assert!(
        matches!(c.alloc(9, 1), Err(Error::InvalidArgument { .. })),
        "unknown request"
    );
    assert!(matches!(c.alloc(1, 5), Err(Error::OutOfPages { .. })));
    let p = c.alloc(1, 4).unwrap();
    let s = c.leak_check().unwrap();
    assert_eq!((s.device_free, s.device_in_use), (0, 4));
    // A page that is neither the request's nor its prefix's cannot be committed.
    let bogus = sparsekit_host::cache::PageRef {
        id: p[0].id,
        generation: 77,
    };
    assert!(c.commit(1, &prompt(1, PAGE), &[bogus]).is_err());
    c.commit(1, &prompt(1, 2 * PAGE + 1), &p[..3]).unwrap();
    let s = c.leak_check().unwrap();
    // p[0], p[1] adopted by the tree; p[2] (partial page) and p[3] still the request's.
    assert_eq!((s.device_in_use, s.device_cached), (2, 2));
    c.finish(1).unwrap();
    assert!(c.finish(1).is_err());
    // No host tier: evicted pages leave the cache.
    assert_eq!(c.evict_device(2).unwrap(), 2);
    let s = c.leak_check().unwrap();
    assert_eq!((s.device_free, s.device_cached, s.host_cached), (4, 0, 0));
}

/// The same round trip on the emulator backend: every copy and checksum of the cache runs
/// the GPU kernels (`copy_pages`, `page_checksums`) under the SIMT emulator.
#[test]
fn prefix_reuse_on_the_emulator_backend() {
    for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
        let mut cfg = CacheConfig::new(6, 16);
        cfg.host_layout = layout;
        let c = cache_on(
            EmuBackend::new(),
            spec(KvDtype::Fp8DsMla, IndexKDtype::Bf16),
            cfg,
        );
        let mut e = Expect::default();
        let a = prompt(1, 4 * PAGE + 2);
        e.request(&c, 1, &a, false).unwrap();
        e.request(&c, 2, &prompt(2, 5 * PAGE), false).unwrap();
        assert_eq!(e.request(&c, 3, &a, false).unwrap(), 4 * PAGE);
        let s = c.leak_check().unwrap();
        assert!(s.backups > 0 && s.hits_host_pages >= 3, "{s:?}");
    }
}
