//! The conformance suite on the CPU backend, once per vector path (AVX-512 with AMX tiles,
//! AVX-512 with the bf16 dot product, AVX-512, AVX2, portable): every path this CPU
//! supports must pass; a path it lacks prints why it skipped. One `#[test]` per check, fresh seed every run (printed on failure;
//! `SPARSEKIT_SEED` replays it).

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use sparsekit_host::cpu::{CpuIsa, Isa};
use sparsekit_host::CpuBackend;

sparsekit_validation::test_backend!(cpu_amx, CpuBackend::with_isa(Isa::Amx));
sparsekit_validation::test_backend!(cpu_avx512bf16, CpuBackend::with_isa(Isa::Avx512Bf16));
sparsekit_validation::test_backend!(cpu_avx512, CpuBackend::with_isa(Isa::Avx512));
sparsekit_validation::test_backend!(cpu_avx2, CpuBackend::with_isa(Isa::Avx2));
sparsekit_validation::test_backend!(cpu_scalar, CpuBackend::with_isa(Isa::Scalar));

/// A sparse MLA call of the tests below, at the conventional softmax scale `1/√d_qk`.
fn mla_op(
    layout: sparsekit_host::layout::KvLayout,
    n_tokens: usize,
    n_heads: usize,
    topk: usize,
) -> sparsekit_host::ops::SparseMla {
    sparsekit_host::ops::SparseMla {
        layout,
        n_tokens,
        n_heads,
        topk,
        softmax_scale: 1.0 / (layout.d_qk() as f32).sqrt(),
    }
}

#[test]
fn the_default_backend_runs_the_process_default_path() {
    assert_eq!(CpuBackend::new().isa(), CpuIsa::get().isa());
    assert!(CpuIsa::get().isa().supported());
    assert_eq!(
        CpuBackend::with_isa(Isa::Scalar).unwrap().isa(),
        Isa::Scalar
    );
    for isa in Isa::ALL {
        assert_eq!(CpuBackend::with_isa(isa).is_ok(), isa.supported(), "{isa}");
    }
}

/// Every vector path (and a one-thread pool) gives the same bits as the portable path for
/// the ops with vector kernels: indexer (decode and long prefill chunks, both index-K
/// dtypes, DeepSeek-V3.2 and tiny dims) and sparse MLA (both KV dtypes, 5, 8, 16 and 64
/// heads: at most 8 take the keys-along route on cores with full-width 512-bit FMAs).
/// The `avx512bf16` path too, but where a value lies in the f32 subnormal range: its
/// `vdpbf16ps` dot products are the f32 paths' FMAs in the same order, except that the
/// instruction flushes subnormal partial sums to zero (`sparsekit_host::cpu::dot`), so
/// there two values may differ by less than 2^-100 (the fixtures' tiny fp8 tiles reach
/// that range in a few outputs). The `amx` path's indexer scores come from AMX tiles,
/// whose accumulation is their own (`sparsekit_host::cpu::amx`): they are held to the
/// reference by its own suite above, and here to the portable path's bits on everything
/// else.
#[test]
fn every_vector_path_gives_identical_bits() {
    use rand::Rng;
    use sparsekit_host::layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout};
    use sparsekit_host::ops::{IndexerLogits, PageTable, QueryRange};
    use sparsekit_host::{Backend, ModelDims};
    use sparsekit_validation::conformance::seed;
    use sparsekit_validation::fixtures::{self, bytes_of, case_rng, Paging};

    let seed = seed();
    let mut backends: Vec<CpuBackend> = CpuIsa::available()
        .into_iter()
        .map(|i| CpuBackend::with_isa(i.isa()).unwrap())
        .collect();
    backends.push(CpuBackend::with_threads(1).unwrap());
    let scalar = CpuBackend::with_isa(Isa::Scalar).unwrap();
    let same = |what: &str, run: &dyn Fn(&CpuBackend) -> Vec<f32>| {
        let want = run(&scalar);
        let tiles = what.starts_with("indexer");
        for b in backends.iter().filter(|b| !tiles || b.isa().same_bits()) {
            let got = run(b);
            let flushes = b.isa() == Isa::Avx512Bf16;
            let differ = got
                .iter()
                .zip(&want)
                .filter(|(g, w)| g.to_bits() != w.to_bits())
                .find(|(g, w)| !flushes || (**g - **w).abs() > 2f32.powi(-100));
            assert!(
                got.len() == want.len() && differ.is_none(),
                "{what}: the {} path differs from the portable one: {differ:?} \
                 (SPARSEKIT_SEED={seed})",
                b.isa()
            );
        }
    };
    let f32s = |bytes: Vec<u8>| -> Vec<f32> {
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let bf16s = |bytes: Vec<u8>| -> Vec<f32> {
        bytes
            .chunks_exact(2)
            .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
            .collect()
    };
    for (i, d) in ModelDims::ALL.iter().enumerate() {
        let rng = &mut case_rng(seed, 0x1500 + i as u64);
        let lens = [300u32, 1, 77, 130];
        let paging = Paging::new(rng, d.page_size, &lens, 1);
        let pt = PageTable::new(&paging.table, paging.max_pages).unwrap();
        // Decode rows, then a 40-row prefill chunk of request 0.
        let mut rows = sparsekit_host::ops::decode_rows(&lens, 1).unwrap();
        rows.extend((0..40).map(|j| QueryRange {
            request: 0,
            start: 0,
            end: 261 + j,
        }));
        // Both index-K dtypes, then fp8 keys with NaN codes in a few keys and two query
        // values past 2^119 (the f16 keys of the avx2 and avx512 paths fall back to f32 for
        // both).
        for (dt, odd) in [
            (IndexKDtype::FP8, false),
            (IndexKDtype::Bf16, false),
            (IndexKDtype::FP8, true),
        ] {
            let l = IndexKLayout::new(dt, d.index_head_dim, d.page_size).unwrap();
            let mut pool = fixtures::index_k_pool(rng, &l, &paging);
            let h = d.index_n_heads;
            let (mut q, w) = fixtures::indexer_inputs(rng, rows.len(), h, l.head_dim());
            if odd {
                let slots = pool.len() / l.bytes_per_page() * l.page_size();
                for slot in (rng.gen_range(0..97)..slots).step_by(97) {
                    let at = l.slot_value_bytes(slot).start + slot % l.head_dim();
                    pool[at] = 0x7f | (slot as u8 & 0x80);
                }
                let dq = l.head_dim();
                q[(h + 1) * dq + 3] = half::bf16::from_f32(2f32.powi(120));
                q[(2 * h + 2) * dq + 5] = half::bf16::from_f32(-(2f32.powi(125)));
            }
            let op = IndexerLogits {
                layout: l,
                n_heads: h,
                page_table: pt,
                rows: rows.clone(),
                row_stride: 301,
            };
            same(
                &format!("indexer_logits {} {dt:?} odd {odd}", d.name),
                &|b| {
                    let mut out = b.upload(&fixtures::poison_f32(rows.len() * 301)).unwrap();
                    b.indexer_logits(
                        &op,
                        &b.upload(bytes_of(&q)).unwrap(),
                        &b.upload(bytes_of(&w)).unwrap(),
                        &b.upload(&pool).unwrap(),
                        &mut out,
                    )
                    .unwrap();
                    f32s(b.download(&out).unwrap())
                },
            );
        }
        for dt in [KvDtype::Bf16, KvDtype::Fp8DsMla] {
            let l = KvLayout::new(dt, d.kv_lora_rank, d.qk_rope_dim, d.page_size).unwrap();
            let pool = fixtures::kv_pool(rng, &l, &paging);
            let topk = d.index_topk.min(150);
            let n_tokens = 5;
            let indices = fixtures::mla_indices(rng, &paging, n_tokens, topk);
            for h in [5, 8, 16, 64] {
                let q = fixtures::bf16_normal(rng, n_tokens * h * l.d_qk(), 1.0);
                let op = mla_op(l, n_tokens, h, topk);
                same(&format!("sparse_mla {} {dt:?} h{h}", d.name), &|b| {
                    let mut out = b
                        .upload(&fixtures::poison_bf16(n_tokens * h * l.nope_dim()))
                        .unwrap();
                    let mut lse = b.upload(&fixtures::poison_f32(n_tokens * h)).unwrap();
                    b.sparse_mla(
                        &op,
                        &b.upload(bytes_of(&q)).unwrap(),
                        &b.upload(&pool).unwrap(),
                        &b.upload(bytes_of(&indices)).unwrap(),
                        &mut out,
                        &mut lse,
                    )
                    .unwrap();
                    let mut values = bf16s(b.download(&out).unwrap());
                    values.extend(f32s(b.download(&lse).unwrap()));
                    values
                });
            }
        }
    }
}

/// The cpu backend's per-thread working buffers (attention, indexer, the matmul's packed
/// blocks) carry nothing from one call to the next: a call made after larger ones (the
/// buffers grown and filled with their values) gives the bits of the same call on a pool
/// of fresh threads, whose buffers are empty.
#[test]
fn per_thread_buffers_carry_nothing_between_calls() {
    use sparsekit_host::cpu::CpuBuffer;
    use sparsekit_host::layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout};
    use sparsekit_host::model_ops::Matmul;
    use sparsekit_host::ops::{IndexerLogits, PageTable};
    use sparsekit_host::{Backend, ModelDims, ModelOps};
    use sparsekit_validation::conformance::seed;
    use sparsekit_validation::fixtures::{self, bytes_of, case_rng, Paging};

    let seed = seed();
    let rng = &mut case_rng(seed, 0x1600);
    let big = ModelDims::DSV32;
    let small = ModelDims::TINY;
    let lens = [300u32, 1, 77, 130];
    // Each call: its output bytes (out, then lse where there is one).
    let indexer = |rng: &mut _, d: ModelDims| {
        let paging = Paging::new(rng, d.page_size, &lens, 1);
        let l = IndexKLayout::new(IndexKDtype::FP8, d.index_head_dim, d.page_size).unwrap();
        let pool = fixtures::index_k_pool(rng, &l, &paging);
        let rows = sparsekit_host::ops::decode_rows(&lens, 1).unwrap();
        let (q, w) = fixtures::indexer_inputs(rng, rows.len(), d.index_n_heads, l.head_dim());
        move |b: &CpuBackend| {
            let op = IndexerLogits {
                layout: l,
                n_heads: d.index_n_heads,
                page_table: PageTable::new(&paging.table, paging.max_pages).unwrap(),
                rows: rows.clone(),
                row_stride: 301,
            };
            let mut out = b.upload(&fixtures::poison_f32(rows.len() * 301)).unwrap();
            let (q, w, pool) = (
                b.upload(bytes_of(&q)).unwrap(),
                b.upload(bytes_of(&w)).unwrap(),
                b.upload(&pool).unwrap(),
            );
            b.indexer_logits(&op, &q, &w, &pool, &mut out).unwrap();
            b.download(&out).unwrap()
        }
    };
    let attention = |rng: &mut _, d: ModelDims, h: usize| {
        let paging = Paging::new(rng, d.page_size, &lens, 1);
        let l = KvLayout::new(KvDtype::Bf16, d.kv_lora_rank, d.qk_rope_dim, d.page_size).unwrap();
        let pool = fixtures::kv_pool(rng, &l, &paging);
        let (n_tokens, topk) = (5, d.index_topk.min(150));
        let indices = fixtures::mla_indices(rng, &paging, n_tokens, topk);
        let q = fixtures::bf16_normal(rng, n_tokens * h * l.d_qk(), 1.0);
        move |b: &CpuBackend| {
            let op = mla_op(l, n_tokens, h, topk);
            let mut out = b
                .upload(&fixtures::poison_bf16(n_tokens * h * l.nope_dim()))
                .unwrap();
            let mut lse = b.upload(&fixtures::poison_f32(n_tokens * h)).unwrap();
            let (q, pool, idx) = (
                b.upload(bytes_of(&q)).unwrap(),
                b.upload(&pool).unwrap(),
                b.upload(bytes_of(&indices)).unwrap(),
            );
            b.sparse_mla(&op, &q, &pool, &idx, &mut out, &mut lse)
                .unwrap();
            let mut bytes = b.download(&out).unwrap();
            bytes.extend(b.download(&lse).unwrap());
            bytes
        }
    };
    let matmul = |rng: &mut _, rows: usize, k: usize, n: usize| {
        let x: Vec<f32> = (0..rows * k)
            .map(|_| fixtures::normal(rng) as f32)
            .collect();
        let w: Vec<f32> = (0..k * n)
            .map(|_| 0.05 * fixtures::normal(rng) as f32)
            .collect();
        move |b: &CpuBackend| {
            let buf = |v: &[f32]| CpuBuffer::from_bytes(bytes_of(v));
            let mut out = CpuBuffer::from_bytes(&fixtures::poison_f32(rows * n));
            ModelOps::matmul(b, &Matmul::dense(rows, k, n), &buf(&x), &buf(&w), &mut out).unwrap();
            out.bytes().to_vec()
        }
    };
    type Call = Box<dyn Fn(&CpuBackend) -> Vec<u8>>;
    let calls: Vec<(&str, Call)> = vec![
        ("indexer, V3.2 dims", Box::new(indexer(rng, big))),
        ("indexer, tiny dims", Box::new(indexer(rng, small))),
        (
            "sparse_mla, V3.2 dims, 64 heads",
            Box::new(attention(rng, big, 64)),
        ),
        (
            "sparse_mla, tiny dims, 16 heads",
            Box::new(attention(rng, small, 16)),
        ),
        (
            "sparse_mla, V3.2 dims, 8 heads",
            Box::new(attention(rng, big, 8)),
        ),
        (
            "matmul 40 x 1100 x 1300",
            Box::new(matmul(rng, 40, 1100, 1300)),
        ),
        (
            "matmul 13 x 300 x 1030",
            Box::new(matmul(rng, 13, 300, 1030)),
        ),
    ];
    for isa in CpuIsa::available() {
        // One pool runs every call, largest first; then each call alone on fresh threads.
        let warm = CpuBackend::with_threads_and_isa(2, isa.isa()).unwrap();
        let after_others: Vec<Vec<u8>> = calls.iter().map(|(_, run)| run(&warm)).collect();
        for ((what, run), got) in calls.iter().zip(&after_others) {
            let fresh = CpuBackend::with_threads_and_isa(2, isa.isa()).unwrap();
            assert!(
                run(&fresh) == *got,
                "{what} on the {} path: a call after others differs from the same call on \
                 fresh threads (SPARSEKIT_SEED={seed})",
                isa.isa()
            );
        }
    }
}
