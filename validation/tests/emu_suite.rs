//! The suite on the emulator backend (the GPU kernels run on the host): every op the
//! backend implements must pass, the others must be reported as not implemented (never
//! as passed), and the kernels' outputs must be bit-identical to the CPU backend's.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use rand::seq::SliceRandom;
use rand::SeedableRng;
use sparsekit_host::layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout};
use sparsekit_host::ops::{IndexKStore, KvStore, Op};
use sparsekit_host::{Backend, CpuBackend, EmuBackend};
use sparsekit_validation::fixtures;
use sparsekit_validation::{run, Size, Status, SuiteConfig};

fn seed() -> u64 {
    std::env::var("SPARSEKIT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random)
}

#[test]
fn emu_passes_what_it_implements_and_reports_the_rest() {
    let seed = seed();
    let cfg = SuiteConfig {
        size: Size::Quick,
        seed,
        ops: Vec::new(),
    };
    let emu = EmuBackend::new();
    let records = run(&emu, &cfg, |_| {});
    let mut failed = Vec::new();
    for op in Op::ALL {
        let recs: Vec<_> = records.iter().filter(|r| r.op == op.name()).collect();
        assert!(!recs.is_empty(), "{}", op.name());
        for r in recs {
            let want = if emu.supports(op) {
                Status::Pass
            } else {
                Status::NotImplemented
            };
            assert!(r.batch >= 4);
            if r.status != want {
                failed.push(format!(
                    "{} {} [{}]: {:?} {}",
                    r.op, r.config, r.dtype, r.status, r.detail
                ));
            }
            assert!(
                r.status != Status::NotImplemented || !r.pass,
                "not implemented never passes"
            );
        }
    }
    assert!(failed.is_empty(), "seed {seed}:\n{}", failed.join("\n"));
}

#[test]
fn emu_stores_are_bit_identical_to_cpu() {
    let seed = seed();
    let mut rng = fixtures::case_rng(seed, 1);
    let (cpu, emu) = (CpuBackend::new(), EmuBackend::new());
    for dims in sparsekit_host::ModelDims::ALL {
        let n = 37usize;
        let pages = n.div_ceil(dims.page_size) + 3;
        let mut slots: Vec<i64> = (0..(pages * dims.page_size) as i64).collect();
        slots.shuffle(&mut rng);
        slots.truncate(n);
        slots[5] = -1;
        for dt in [IndexKDtype::FP8, IndexKDtype::Bf16] {
            let l = IndexKLayout::new(dt, dims.index_head_dim, dims.page_size).unwrap();
            let cache0 = fixtures::garbage(&mut rng, l.buffer_bytes(pages));
            let keys = fixtures::token_rows(&mut rng, n, l.head_dim());
            let op = IndexKStore {
                layout: l,
                slots: &slots,
            };
            let mut a = cpu.upload(&cache0).unwrap();
            let mut b = emu.upload(&cache0).unwrap();
            cpu.index_k_store(&op, &cpu.upload(fixtures::bytes_of(&keys)).unwrap(), &mut a)
                .unwrap();
            emu.index_k_store(&op, &emu.upload(fixtures::bytes_of(&keys)).unwrap(), &mut b)
                .unwrap();
            assert!(
                cpu.download(&a).unwrap() == emu.download(&b).unwrap(),
                "index-K {dt:?} seed {seed}"
            );
        }
        for dt in [KvDtype::Bf16, KvDtype::Fp8DsMla] {
            let l = KvLayout::new(dt, dims.kv_lora_rank, dims.qk_rope_dim, dims.page_size).unwrap();
            let cache0 = fixtures::garbage(&mut rng, l.buffer_bytes(pages));
            let kv = fixtures::token_rows(&mut rng, n, l.d_qk());
            let op = KvStore {
                layout: l,
                slots: &slots,
            };
            let mut a = cpu.upload(&cache0).unwrap();
            let mut b = emu.upload(&cache0).unwrap();
            cpu.kv_store(&op, &cpu.upload(fixtures::bytes_of(&kv)).unwrap(), &mut a)
                .unwrap();
            emu.kv_store(&op, &emu.upload(fixtures::bytes_of(&kv)).unwrap(), &mut b)
                .unwrap();
            assert!(
                cpu.download(&a).unwrap() == emu.download(&b).unwrap(),
                "KV {dt:?} seed {seed}"
            );
        }
    }
    let _ = rand_chacha::ChaCha8Rng::seed_from_u64(0);
}
