//! The cache's public API used wrongly on purpose (found by a hostile-caller review): a
//! transfer opened under a live step, and writes into pages a transfer already landed
//! (and a commit while the transfer is open) are refused — no read before ready, no write
//! into pages others may read.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use crate::common;

use common::{cache, read_pages, source, spec, LAYERS};
use sparsekit_host::cache::{BufferKind, CacheConfig};
use sparsekit_host::layout::{IndexKDtype, KvDtype};

/// A step opened before `HiCache::inbound` copied the request's fences without the
/// transfer's: the inbound is refused while the request is in a live step (else the step
/// would read pages nothing landed in).
#[test]
fn an_inbound_is_refused_while_its_request_is_in_a_live_step() {
    let c = cache(
        spec(KvDtype::Bf16, IndexKDtype::Bf16),
        CacheConfig::new(6, 0),
    );
    c.begin(1, &[]).unwrap();
    let pages = c.alloc(1, 2).unwrap();
    let step = c.step(&[1]).unwrap();
    let rx = c.inbound(1, &pages);
    assert!(
        rx.as_ref()
            .is_err_and(|e| e.to_string().contains("live step")),
        "{:?}",
        rx.map(|_| ())
    );
    // Once the step is gone the transfer opens.
    drop(step);
    assert!(c.inbound(1, &pages).is_ok());
}

/// After a transfer landed and published every layer, the still-open `Inbound` may not
/// write a landed page again (its bytes may have been read), and the request may not
/// commit its pages to the prefix tree while the transfer is open.
#[test]
fn landed_pages_are_never_overwritten_nor_committed_while_the_transfer_is_open() {
    let c = cache(
        spec(KvDtype::Bf16, IndexKDtype::Bf16),
        CacheConfig::new(6, 0),
    );
    let b = c.backend();
    let ps = c.spec().page_size();
    let tokens: Vec<u32> = (0..(2 * ps) as u32).map(|t| 7000 + t).collect();
    c.begin(1, &[]).unwrap();
    let pages = c.alloc(1, 2).unwrap();
    let mut rx = c.inbound(1, &pages).unwrap();
    let ids: Vec<i32> = (0..2).collect();
    for l in 0..LAYERS {
        let (kv, kr, ks) = source(b, c.spec().kv, 2, 10 + l as u8);
        let (ik, ir, is) = source(b, c.spec().index_k, 2, 50 + l as u8);
        rx.write(l, BufferKind::Kv, &pages, &kv, kr, &ids, &ks)
            .unwrap();
        rx.write(l, BufferKind::IndexK, &pages, &ik, ir, &ids, &is)
            .unwrap();
    }
    // Every layer published; the transfer is still open: a commit is refused.
    let e = c.commit(1, &tokens, &pages);
    assert!(
        e.as_ref()
            .is_err_and(|e| e.to_string().contains("transfer still open")),
        "{e:?}"
    );
    let before = {
        let mut s = c.step(&[1]).unwrap();
        let g = s.wait_layer(0).unwrap();
        read_pages(&c, &g, &pages).unwrap()
    };
    // The transfer writes layer 0 again, with other bytes (and their checksums): refused.
    let (kv, kr, ks) = source(b, c.spec().kv, 2, 99);
    let r = rx.write(0, BufferKind::Kv, &pages, &kv, kr, &ids, &ks);
    assert!(
        r.as_ref()
            .is_err_and(|e| e.to_string().contains("landed already")),
        "{r:?}"
    );
    let after = {
        let mut s = c.step(&[1]).unwrap();
        let g = s.wait_layer(0).unwrap();
        read_pages(&c, &g, &pages).unwrap()
    };
    assert_eq!(before, after, "the landed bytes are unchanged");
    // Completed, the pages commit and are shared.
    rx.complete().unwrap();
    c.commit(1, &tokens, &pages).unwrap();
    let mut longer = tokens.clone();
    longer.push(1);
    let prefix = c.begin(2, &longer).unwrap();
    assert_eq!(prefix.pages, pages, "request 2 reuses the committed pages");
}
