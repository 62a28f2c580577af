//! Property tests of the hierarchical cache: random sequences of requests (with shared
//! prefixes), held (live) requests, aborts and evictions, over every KV × index-K dtype
//! pair, both host layouts, with and without write-through. After every step no page leaks
//! (leak_check: pages, pins, locks, live paths); every page served from either tier is
//! bit-identical to what was computed for that prefix. (The concurrent version of this
//! test is `cache_model.rs`.)

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use crate::common;

use common::{cache, spec, Expect, LAYERS, PAGE};
use proptest::prelude::*;
use sparsekit_host::cache::{CacheConfig, HostLayout};
use sparsekit_host::layout::{IndexKDtype, KvDtype};
use sparsekit_host::Error;

#[derive(Clone, Debug)]
enum Step {
    /// A whole request: family prefix + suffix, committed (or aborted).
    Run {
        family: u32,
        suffix: Vec<u32>,
        abort: bool,
    },
    /// Begin a request and keep it live (its prefix stays locked).
    Hold { family: u32 },
    /// Finish the oldest held request.
    Release,
    /// Push cached pages out of the device tier.
    Evict(usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0..4u32, prop::collection::vec(0..3u32, 0..3 * PAGE), any::<bool>())
            .prop_map(|(family, suffix, abort)| Step::Run { family, suffix, abort }),
        1 => (0..4u32).prop_map(|family| Step::Hold { family }),
        1 => Just(Step::Release),
        1 => (0..5usize).prop_map(Step::Evict),
    ]
}

fn tokens(family: u32, suffix: &[u32]) -> Vec<u32> {
    let mut t: Vec<u32> = (0..(2 * PAGE + 1) as u32)
        .map(|i| 100 * (family + 1) + i)
        .collect();
    t.extend(suffix);
    t
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn no_leaks_and_bit_exact_round_trips(
        kv in prop::sample::select(vec![KvDtype::Bf16, KvDtype::Fp8DsMla]),
        ik in prop::sample::select(vec![IndexKDtype::FP8, IndexKDtype::Bf16]),
        layout in prop::sample::select(vec![HostLayout::LayerFirst, HostLayout::PageFirst]),
        host_pages in prop::sample::select(vec![0usize, 5, 12]),
        write_through in any::<bool>(),
        steps in prop::collection::vec(step(), 1..24),
    ) {
        let mut cfg = CacheConfig::new(8, host_pages);
        cfg.host_layout = layout;
        cfg.write_through = write_through;
        let c = cache(spec(kv, ik), cfg);
        let e = Expect::default();
        let mut held = std::collections::VecDeque::new();
        let mut next_req = 1u64;
        for s in &steps {
            match s {
                Step::Run { family, suffix, abort } => {
                    let r = e.request(&c, next_req, &tokens(*family, suffix), *abort);
                    next_req += 1;
                    if let Err(err) = r {
                        // Only running out of device pages (held requests lock them) is
                        // acceptable; anything else is a defect.
                        prop_assert!(matches!(err, Error::OutOfPages { .. }), "{err}");
                    }
                }
                Step::Hold { family } => {
                    let p = c.begin(next_req, &tokens(*family, &[]));
                    match p {
                        Ok(_) => {
                            let step = c.step(&[next_req]).unwrap();
                            for l in 0..LAYERS {
                                step.wait(l).unwrap();
                            }
                            held.push_back(next_req);
                        }
                        Err(err) => prop_assert!(matches!(err, Error::OutOfPages { .. }), "{err}"),
                    }
                    next_req += 1;
                }
                Step::Release => {
                    if let Some(r) = held.pop_front() {
                        c.finish(r).unwrap();
                    }
                }
                Step::Evict(n) => {
                    c.evict_device(*n).unwrap();
                }
            }
            let stats = c.leak_check();
            prop_assert!(stats.is_ok(), "after {s:?}: {stats:?}");
        }
        for r in held {
            c.finish(r).unwrap();
        }
        c.wait_idle().unwrap();
        let s = c.leak_check().unwrap();
        prop_assert_eq!(s.device_in_use, 0);
        prop_assert_eq!(s.device_quarantined, 0);
        prop_assert_eq!(s.device_free + s.device_cached, s.device_pages);
        prop_assert_eq!(s.host_free + s.host_cached, s.host_pages);
        prop_assert_eq!(s.integrity_failures, 0);
    }
}
