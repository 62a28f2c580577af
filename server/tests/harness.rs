//! The integrity harness end to end at a small scale (the tiny model, 3 sessions of 3
//! turns, the device pool a fraction of the working set so reuse goes through the host
//! tier), through the HTTP server, against references computed once:
//!
//! - the four PD-off configurations serve every session bit-identically, reuse prefixes
//!   through both tiers, and leave no page leaked or quarantined;
//! - each non-PD injection is caught with the checks on (0 corrupted, detections > 0) and
//!   corrupts sessions with `--no-verify`; an unaffected configuration stays clean;
//! - client aborts over two rounds leave nothing behind;
//! - a running server is measured through its URL like an in-process one.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use sparsekit_host::{CpuBackend, IndexKDtype, KvDtype};
use sparsekit_server::engine::{Engine, ModelConfig};
use sparsekit_server::harness::config::{select, ConfigKey, Injection};
use sparsekit_server::harness::deploy::{remote_info, LocalRunner, RunPlan, UrlRunner};
use sparsekit_server::harness::report::{EvidenceRow, Verdict};
use sparsekit_server::harness::repro::{reference_runs, run_configs, sizing, ReproOptions};
use sparsekit_server::harness::{SessionTrace, Workload, WorkloadConfig};
use sparsekit_server::metrics::Metrics;
use sparsekit_validation::audit::ReferenceAudit;

fn options(turns: usize, model: ModelConfig) -> ReproOptions {
    ReproOptions {
        workload: WorkloadConfig {
            sessions: 3,
            turns,
            contexts: 2,
            max_jitter_ms: 5,
            seed: 3,
        },
        // Two layers: an early read in layer 0 shows in layer 1's stored keys (with one
        // layer it shows only if that step computes logits).
        model,
        deadline: Duration::from_secs(120),
        idle_bound: Duration::from_secs(30),
        health_every: Duration::from_millis(20),
        ..Default::default()
    }
}

struct Shared {
    model: ModelConfig,
    w: Workload,
    refs: HashMap<&'static str, Vec<SessionTrace>>,
    plan: RunPlan,
}

fn prepare(turns: usize, dtypes: &[IndexKDtype], model: ModelConfig) -> Shared {
    prepare_kv(turns, dtypes, model, KvDtype::Bf16)
}

fn prepare_kv(turns: usize, dtypes: &[IndexKDtype], model: ModelConfig, kv: KvDtype) -> Shared {
    let o = ReproOptions {
        kv_dtype: kv,
        ..options(turns, model)
    };
    let w = Workload::generate(&o.workload);
    let refs = reference_runs(Arc::new(CpuBackend::new()), &o, &w, dtypes, &|| {}).unwrap();
    {
        let all: Vec<&[SessionTrace]> = refs.values().map(Vec::as_slice).collect();
        let plan = RunPlan {
            model: o.model,
            seed: o.seed,
            kv_dtype: o.kv_dtype,
            sizing: sizing(&w, &all, o.model.page_size()),
            max_running: o.workload.sessions,
            injection: None,
            verify: true,
            cache_wait: o.cache_wait,
            deadline: o.deadline,
            audit: Some(Arc::new(ReferenceAudit)),
            kernel_check_every: 4,
        };
        eprintln!("sizing: {:?}", plan.sizing);
        Shared {
            model,
            w,
            refs,
            plan,
        }
    }
}

/// Three turns (turns ≥ 3 give the speed-up), both dtypes: computed once.
fn three_turns() -> &'static Shared {
    static S: OnceLock<Shared> = OnceLock::new();
    S.get_or_init(|| prepare(3, &[IndexKDtype::FP8, IndexKDtype::Bf16], ModelConfig::TINY))
}

/// Two turns (the second reuses the first through the host tier), bf16: computed once.
fn two_turns() -> &'static Shared {
    static S: OnceLock<Shared> = OnceLock::new();
    S.get_or_init(|| prepare(2, &[IndexKDtype::Bf16], ModelConfig::TINY))
}

/// Two turns of DeepSeek-V4's model (`dsv4-tiny`), bf16 index keys: computed once.
fn two_turns_v4() -> &'static Shared {
    static S: OnceLock<Shared> = OnceLock::new();
    S.get_or_init(|| prepare(2, &[IndexKDtype::Bf16], ModelConfig::DSV4_TINY))
}

/// [`two_turns_v4`] with fp8 KV (V4 stores it as model1_fp8): computed once.
fn two_turns_v4_model1() -> &'static Shared {
    static S: OnceLock<Shared> = OnceLock::new();
    S.get_or_init(|| {
        prepare_kv(
            2,
            &[IndexKDtype::Bf16],
            ModelConfig::DSV4_TINY,
            KvDtype::Fp8DsMla,
        )
    })
}

fn run(
    s: &Shared,
    configs: &str,
    injection: Option<Injection>,
    verify: bool,
    abort_rate: f64,
    rounds: usize,
) -> Vec<EvidenceRow> {
    run_with(s, configs, injection, verify, abort_rate, rounds, true)
}

/// Only the servers' checks judge the rows (`--no-reference`).
fn run_checks_only(s: &Shared, configs: &str, injection: Option<Injection>) -> Vec<EvidenceRow> {
    run_with(s, configs, injection, true, 0.0, 1, false)
}

fn run_with(
    s: &Shared,
    configs: &str,
    injection: Option<Injection>,
    verify: bool,
    abort_rate: f64,
    rounds: usize,
    reference: bool,
) -> Vec<EvidenceRow> {
    let filters: Vec<String> = configs.split(',').map(String::from).collect();
    let opts = ReproOptions {
        configs: select(&filters).unwrap(),
        injection,
        verify,
        abort_rate,
        rounds,
        reference,
        kv_dtype: s.plan.kv_dtype,
        ..options(s.w.config.turns, s.model)
    };
    let plan = RunPlan {
        injection,
        verify,
        ..s.plan.clone()
    };
    let local = LocalRunner {
        backend: Arc::new(CpuBackend::new()),
    };
    let none = HashMap::new();
    let refs = if reference { &s.refs } else { &none };
    let rows = run_configs(&[&local], &opts, &plan, &s.w, refs, &|| {}, &|_| {});
    eprint!("{}", sparsekit_server::harness::render_table(&rows));
    rows
}

fn assert_clean(r: &EvidenceRow) {
    assert!(r.available, "{r:?}");
    assert_eq!(
        r.corrupted,
        Some(0),
        "{}: corrupted {:?}",
        r.config,
        r.first_divergences
    );
    assert_eq!(r.refused, Some(0), "{}", r.config);
    assert_eq!(r.detected, Some(0), "{}", r.config);
    assert_eq!(r.wedged, Some(0), "{}", r.config);
    assert_eq!(r.leaked_pages, Some(0), "{}", r.config);
    assert_eq!(r.quarantined_pages, Some(0), "{}", r.config);
}

#[test]
fn the_pd_off_configs_are_clean_and_reuse_through_the_host_tier() {
    let s = three_turns();
    let ws = (s.plan.sizing.host_pages - 64) * 4 / 5;
    assert!(
        s.plan.sizing.device_pages < ws,
        "the device pool must be smaller than the working set: {:?}",
        s.plan.sizing
    );
    let rows = run(s, "pd-off", None, true, 0.0, 1);
    assert_eq!(rows.len(), 4);
    for r in &rows {
        assert_clean(r);
        assert_eq!(r.sessions, Some(3));
        assert!(r.ttft_p99_ms.is_some() && r.health_p99_ms.is_some());
        assert_eq!(r.ttft_by_turn_ms.len(), 3);
        assert!(r.device_hit_rate.is_some_and(|x| x > 0.0), "{}", r.config);
        if r.host_tier == "on" {
            assert!(
                r.host_hit_rate.is_some_and(|x| x > 0.0),
                "{}: reuse went through the host tier",
                r.config
            );
            assert!(r.ttft_speedup_turn3plus.is_some(), "{}", r.config);
        } else {
            assert!(r.host_hit_rate.is_none() && r.ttft_speedup_turn3plus.is_none());
        }
    }
}

/// The four PD-on configurations through an in-process prefill/decode pair: every prompt
/// page of both kinds crosses the transfer, sessions match the reference bit for bit,
/// prefill's host tier is used, nothing is left leaked or quarantined.
#[test]
fn the_pd_on_configs_are_clean_through_a_prefill_decode_pair() {
    let s = three_turns();
    let rows = run(s, "pd-on", None, true, 0.0, 1);
    assert_eq!(rows.len(), 4);
    for r in &rows {
        assert_clean(r);
        assert_eq!(r.sessions, Some(3));
        assert_eq!(r.refused_frames, Some(0), "{}", r.config);
        if r.host_tier == "on" {
            assert!(
                r.host_hit_rate.is_some_and(|x| x > 0.0),
                "{}: prefill reused through its host tier",
                r.config
            );
        }
        assert!(r
            .note
            .as_deref()
            .unwrap_or("")
            .contains("prefill/decode pair"));
    }
}

#[test]
fn each_injection_is_caught_with_checks_on_and_corrupts_with_them_off() {
    let s = two_turns();
    for inj in [
        Injection::HostPoolFp8Layout,
        Injection::SharedItemSize,
        Injection::SkipIndexWait,
        Injection::NoGenerationCheck,
        Injection::IndexKAfterPublish,
        Injection::RadixOverreach,
        Injection::KernelWrongSlot,
        Injection::HostTierSkipsIndexK,
        Injection::ReloadKvOnly,
    ] {
        for verify in [true, false] {
            let rows = run(s, "bf16/host-on/pd-off", Some(inj), verify, 0.0, 1);
            let r = &rows[0];
            let want = if verify {
                Verdict::Caught
            } else {
                Verdict::Reproduced
            };
            assert_eq!(
                r.verdict,
                Some(want),
                "{} verify={verify}: corrupted {:?} refused {:?} detected {:?}",
                inj.name(),
                r.corrupted,
                r.refused,
                r.detected
            );
            if verify {
                // What production has: the servers' own counters saw it.
                assert!(!r.caught_by.is_empty(), "{}: {r:?}", inj.name());
            }
            if verify && inj.preventable() {
                assert_eq!(r.corrupted, Some(0));
                // Caught and served: a check repaired it (waited for the bytes or
                // recomputed the prefix); nobody's request was refused.
                assert_eq!(r.refused, Some(0), "{}: {:?}", inj.name(), r.note);
            } else if !verify {
                assert!(r.corrupted.unwrap_or(0) > 0);
            }
            assert_eq!(r.leaked_pages, Some(0), "{} verify={verify}", inj.name());
            assert_eq!(
                r.quarantined_pages,
                Some(0),
                "{} verify={verify}: pages left quarantined at the idle check",
                inj.name()
            );
            assert_eq!(r.wedged, Some(0), "{} verify={verify}", inj.name());
        }
    }
    // Where an injection cannot bite (no host tier: no loads to overtake), it stays clean
    // and says so.
    let rows = run(
        s,
        "bf16/host-off/pd-off",
        Some(Injection::SkipIndexWait),
        false,
        0.0,
        1,
    );
    assert_eq!(rows[0].verdict, Some(Verdict::NotAffected));
    assert_eq!(rows[0].corrupted, Some(0));
}

/// The PD injections on the bf16 PD config with the host tier (pd-fp8-frame bites only
/// bf16 index keys): caught by the receiver's frame checks / the landed stamps / the
/// reusing transfer's checksums with the checks on, corrupting with `--no-verify`; nothing
/// leaked or left quarantined either way.
#[test]
fn pd_injections_are_caught_with_checks_on_and_corrupt_with_them_off() {
    let s = two_turns();
    for inj in [
        Injection::PdFp8Frame,
        Injection::PdReadBeforeLanded,
        Injection::StaleTransferWrite,
    ] {
        for verify in [true, false] {
            let rows = run(s, "bf16/host-on/pd-on", Some(inj), verify, 0.0, 1);
            let r = &rows[0];
            let want = if verify {
                Verdict::Caught
            } else {
                Verdict::Reproduced
            };
            assert_eq!(
                r.verdict,
                Some(want),
                "{} verify={verify}: corrupted {:?} refused {:?} detected {:?} frames {:?} {:?}",
                inj.name(),
                r.corrupted,
                r.refused,
                r.detected,
                r.refused_frames,
                r.note
            );
            if verify {
                assert_eq!(r.corrupted, Some(0));
                assert!(!r.caught_by.is_empty(), "{}: {r:?}", inj.name());
            }
            assert_eq!(r.leaked_pages, Some(0), "{} verify={verify}", inj.name());
            assert_eq!(
                r.quarantined_pages,
                Some(0),
                "{} verify={verify}: pages left quarantined at the idle check",
                inj.name()
            );
            assert_eq!(r.wedged, Some(0), "{} verify={verify}", inj.name());
        }
    }
}

/// Every page of the decode pool is back (free) once the pair is idle after
/// `pd-read-before-landed`, with the checks on and off. The decode requests end (failed
/// by the landed stamps, or served without waiting) while prefill is still computing and
/// sending their prompts: their pages are rightly quarantined until each transfer is
/// confirmed ended, which the receiver asks for as soon as the request ends; the idle
/// state is read from accounting checks made after the last transfer ended.
#[test]
fn pd_read_before_landed_leaves_nothing_quarantined() {
    let s = two_turns();
    for verify in [true, false] {
        let rows = run(
            s,
            "bf16/host-on/pd-on",
            Some(Injection::PdReadBeforeLanded),
            verify,
            0.0,
            1,
        );
        assert_eq!(rows[0].leaked_pages, Some(0), "verify={verify}");
        assert_eq!(rows[0].quarantined_pages, Some(0), "verify={verify}");
    }
}

#[test]
fn client_aborts_over_rounds_leave_nothing_behind() {
    let rows = run(two_turns(), "bf16/host-on", None, true, 0.4, 2);
    assert_eq!(rows.len(), 4, "PD off and on, two rounds each");
    assert_eq!(
        rows.iter().map(|r| r.round).collect::<Vec<_>>(),
        [Some(1), Some(2), Some(1), Some(2)]
    );
    let aborted: usize = rows.iter().map(|r| r.aborted.unwrap_or(0)).sum();
    assert!(aborted > 0, "some sessions were aborted");
    for r in &rows {
        assert_eq!(r.corrupted, Some(0), "{:?}", r.first_divergences);
        assert_eq!((r.leaked_pages, r.quarantined_pages), (Some(0), Some(0)));
        assert_eq!(r.wedged, Some(0));
        assert!(r.health_p99_ms.is_some());
    }
}

#[test]
fn a_running_server_is_measured_through_its_url() {
    let s = two_turns();
    let key = ConfigKey {
        index_k: IndexKDtype::Bf16,
        host_tier: true,
        pd: false,
        small_decode: false,
    };
    let engine = Arc::new(
        Engine::start(
            Arc::new(CpuBackend::new()),
            s.plan.model,
            s.plan.engine_options(&key),
            Arc::new(Metrics::new("both")),
        )
        .unwrap(),
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let server = rt
        .block_on(sparsekit_server::http::spawn(
            engine,
            "127.0.0.1:0".parse().unwrap(),
            Default::default(),
        ))
        .unwrap();
    let info = remote_info(server.addr).unwrap();
    assert_eq!(info.key, key);
    assert_eq!((info.model, info.seed), (s.plan.model, s.plan.seed));
    let runner = UrlRunner {
        servers: vec![info],
    };
    let opts = ReproOptions {
        configs: vec![key],
        ..options(2, ModelConfig::TINY)
    };
    let rows = run_configs(&[&runner], &opts, &s.plan, &s.w, &s.refs, &|| {}, &|_| {});
    assert_eq!(rows.len(), 1);
    assert_clean(&rows[0]);
    assert!(rows[0]
        .note
        .as_deref()
        .unwrap_or("")
        .contains("running server"));
    // A configuration no server serves is unavailable.
    let opts = ReproOptions {
        configs: vec![key.without_host_tier()],
        ..options(2, ModelConfig::TINY)
    };
    let rows = run_configs(&[&runner], &opts, &s.plan, &s.w, &s.refs, &|| {}, &|_| {});
    assert!(!rows[0].available);
    rt.block_on(server.shutdown(Duration::from_secs(10)))
        .unwrap();
}

/// In production there is no reference run: the injections that only a reference run
/// saw before (an index-K copied after its layer was published, a radix match one token
/// too long, a kernel bug both runs share) are caught by the servers' own checks alone
/// (`--no-reference`); the table says which check counted them, and the cache ones are
/// served (nothing refused). (Every injection's rows with the reference on also show
/// what the servers' checks counted: `each_injection_…`, `pd_injections_…`.)
#[test]
fn the_blind_spots_are_caught_by_the_checks_alone() {
    let s = two_turns();
    for inj in [
        Injection::IndexKAfterPublish,
        Injection::RadixOverreach,
        Injection::KernelWrongSlot,
        Injection::HostTierSkipsIndexK,
        Injection::ReloadKvOnly,
    ] {
        let config = if inj.needs_pd() {
            "bf16/host-on/pd-on"
        } else {
            "bf16/host-on/pd-off"
        };
        let rows = run_checks_only(s, config, Some(inj));
        let r = rows.iter().find(|r| r.available).unwrap();
        assert!(!r.reference && r.corrupted.is_none());
        assert_eq!(
            r.verdict,
            Some(Verdict::Caught),
            "{}: detected {:?} refused {:?} caught by {:?} {:?}",
            inj.name(),
            r.detected,
            r.refused,
            r.caught_by,
            r.note
        );
        assert!(!r.caught_by.is_empty(), "{}", inj.name());
        if inj == Injection::KernelWrongSlot {
            assert!(r.kernel_mismatches.unwrap_or(0) > 0, "{r:?}");
        }
        if !inj.needs_pd() {
            assert_eq!(r.refused, Some(0), "{}: {:?}", inj.name(), r.note);
        }
        assert_eq!(r.leaked_pages, Some(0), "{}", inj.name());
        assert_eq!(r.wedged, Some(0), "{}", inj.name());
    }
}

/// A PD decode pool far smaller than the load: requests wait for decode pages behind
/// transfers and are served bit-identically; nothing wedges, nothing is left held.
#[test]
fn a_small_decode_pool_is_clean() {
    let s = two_turns();
    let rows = run(s, "decode-small", None, true, 0.0, 1);
    assert_eq!(rows.len(), 1);
    assert!(s.plan.sizing.small_decode_pages < s.plan.sizing.decode_pages);
    assert_clean(&rows[0]);
    assert!(rows[0].kernel_checks.unwrap_or(0) > 0, "{:?}", rows[0]);
    assert_eq!(rows[0].kernel_mismatches, Some(0));
}

/// DeepSeek-V4's model through the harness: the host-tier rows (PD off and on) serve every
/// session bit-identically with all five pools, and the pool injections — the host tier
/// skipping index-K (SGLang 17085), a reload restoring only the KV (Mooncake 2236), the
/// compressor's state left behind, the compressed pools backed up with the window pool's
/// page size — are caught by the servers' checks alone (no
/// reference: as in production), served (nothing refused), and corrupt sessions with the
/// checks off.
#[test]
fn v4_rows_are_clean_and_the_pool_injections_are_caught() {
    let s = two_turns_v4();
    let rows = run(s, "bf16/host-on", None, true, 0.0, 1);
    assert_eq!(rows.len(), 2);
    for r in &rows {
        assert_clean(r);
        assert!(
            r.host_hit_rate.is_some_and(|x| x > 0.0),
            "{}: reuse through the host tier",
            r.config
        );
    }
    for inj in [
        Injection::HostTierSkipsIndexK,
        Injection::ReloadKvOnly,
        Injection::CompressorStateLost,
        Injection::PoolPageSizeMismatch,
    ] {
        let r = &run_checks_only(s, "bf16/host-on/pd-off", Some(inj))[0];
        assert_eq!(r.verdict, Some(Verdict::Caught), "{}: {r:?}", inj.name());
        assert_eq!(r.refused, Some(0), "{}: {:?}", inj.name(), r.note);
        assert!(r.fallbacks.unwrap_or(0) > 0, "{}: {r:?}", inj.name());
        let r = &run(s, "bf16/host-on/pd-off", Some(inj), false, 0.0, 1)[0];
        assert_eq!(
            r.verdict,
            Some(Verdict::Reproduced),
            "{}: {r:?}",
            inj.name()
        );
        assert_eq!(r.leaked_pages, Some(0), "{}", inj.name());
        assert_eq!(r.wedged, Some(0), "{}", inj.name());
    }
}

/// DeepSeek-V4 with model1_fp8 KV over PD: every prompt's partly filled last page crosses
/// as its entries' bytes (rows, then the tile scales at the page's end) and every session
/// is served bit-identically; `model1-scales-as-interleaved` (prefill copies that page as
/// if token-interleaved, leaving the scales behind) is caught by decode's per-page
/// checksums alone (no reference) and corrupts sessions with the checks off.
#[test]
fn v4_model1_pages_cross_pd_and_the_interleaved_copy_is_caught() {
    let s = two_turns_v4_model1();
    let rows = run(s, "bf16/host-on/pd-on", None, true, 0.0, 1);
    assert_eq!(rows.len(), 1);
    assert_clean(&rows[0]);
    let inj = Injection::Model1ScalesAsInterleaved;
    let r = &run_checks_only(s, "bf16/host-on/pd-on", Some(inj))[0];
    assert_eq!(r.verdict, Some(Verdict::Caught), "{r:?}");
    assert!(
        r.caught_by.iter().any(|c| c.check.contains("checksum")),
        "{r:?}"
    );
    let r = &run(s, "bf16/host-on/pd-on", Some(inj), false, 0.0, 1)[0];
    assert_eq!(r.verdict, Some(Verdict::Reproduced), "{r:?}");
    assert_eq!(r.leaked_pages, Some(0));
    assert_eq!(r.wedged, Some(0));
}
