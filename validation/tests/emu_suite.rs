//! The conformance suite on the emulator backend (the GPU kernels run on the host), plus
//! what only GPU-kernel backends must do: refuse shapes past the kernels' limits, and
//! store bytes bit-identical to the CPU backend's.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use rand::seq::SliceRandom;
use sparsekit_host::layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout};
use sparsekit_host::ops::{IndexKStore, KvStore};
use sparsekit_host::{Backend, CpuBackend, EmuBackend};
use sparsekit_validation::conformance::{self, errors};
use sparsekit_validation::fixtures;

sparsekit_validation::test_backend!(emu, Ok(EmuBackend::new()));

/// DeepSeek-V4's attention checks on the emulator as `sm_120a`: the kernel's score product
/// on the block-scaled MXFP8 mma (queries split into two e4m3 parts, the MODEL1 codes and
/// tile scales as stored) where every cache is `model1_fp8`, the bf16 path elsewhere.
mod emu_sm120a {
    use sparsekit_host::{EmuBackend, EmuTarget};
    use sparsekit_validation::conformance::{self as c, Op};

    fn open() -> sparsekit_host::Result<EmuBackend> {
        Ok(EmuBackend::new().with_target(EmuTarget::Sm120a))
    }

    #[test]
    fn sparse_mla_v4() {
        c::run_check("emu_sm120a", "sparse_mla_v4", open, |b| {
            c::suite_op(b, Op::SparseMlaV4)
        })
    }

    #[test]
    fn documented_v4_sinks_and_empty_rows() {
        c::run_check(
            "emu_sm120a",
            "documented_v4_sinks_and_empty_rows",
            open,
            c::v4::sinks_and_empty_rows,
        )
    }

    #[test]
    fn nonfinite_v4() {
        c::run_check("emu_sm120a", "nonfinite_v4", open, c::v4::nonfinite)
    }
}

#[test]
fn emu_rejects_shapes_its_kernels_cannot_run() {
    errors::gpu_kernel_limits(&EmuBackend::new()).unwrap();
}

#[test]
fn emu_stores_are_bit_identical_to_cpu() {
    let seed = conformance::seed();
    let mut rng = fixtures::case_rng(seed, 1);
    let (cpu, emu) = (CpuBackend::new(), EmuBackend::new());
    for dims in sparsekit_host::ModelDims::ALL {
        let n = 37usize;
        let pages = n.div_ceil(dims.page_size) + 3;
        let mut slots: Vec<i64> = (0..(pages * dims.page_size) as i64).collect();
        slots.shuffle(&mut rng);
        slots.truncate(n);
        slots[5] = -1;
        for dt in [IndexKDtype::FP8, IndexKDtype::Bf16, IndexKDtype::Fp4E2m1] {
            // fp4 keys need a head dim that is a multiple of 128.
            let Ok(l) = IndexKLayout::new(dt, dims.index_head_dim, dims.page_size) else {
                continue;
            };
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
        let mut kv_layouts: Vec<KvLayout> = [KvDtype::Bf16, KvDtype::Fp8DsMla]
            .map(|dt| {
                KvLayout::new(dt, dims.kv_lora_rank, dims.qk_rope_dim, dims.page_size).unwrap()
            })
            .to_vec();
        // DeepSeek-V4's layouts at this config's page size.
        kv_layouts.push(KvLayout::model1_fp8(dims.page_size).unwrap());
        kv_layouts.push(KvLayout::bf16_512(dims.page_size).unwrap());
        for l in kv_layouts {
            let dt = l.dtype();
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
}
