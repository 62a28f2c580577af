//! The conformance suite on the CUDA backend (the embedded PTX on the first GPU), plus what
//! only this backend can show: shapes past the kernels are refused, and a page copy on the
//! copy stream overlaps a kernel on the compute stream.
//!
//! Without a CUDA driver (or without PTX in this build) every test prints why it skipped;
//! `scripts/gpu-check.sh` sets `SPARSEKIT_REQUIRE_BACKENDS=cuda` so that there a skip is a
//! failure.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use sparsekit::cuda::{CudaBackend, CudaBuffer};
use sparsekit::host::layout::{IndexKDtype, IndexKLayout};
use sparsekit::host::ops::{CopyPages, PagedRegion, QueryRange, Topk, TopkOutput};
use sparsekit::host::{Backend, StreamKind};
use sparsekit::validation::conformance::{self, ensure, errors, Outcome};
use sparsekit::validation::fixtures;

sparsekit_validation::test_backend!(cuda, CudaBackend::new(0));

#[test]
fn cuda_rejects_shapes_its_kernels_cannot_run() {
    conformance::run_check(
        "cuda",
        "kernel_limits",
        || CudaBackend::new(0),
        errors::gpu_kernel_limits,
    );
}

/// Milliseconds from `origin` to each event (`origin` recorded first).
fn at(origin: &cudarc::driver::CudaEvent, e: &cudarc::driver::CudaEvent) -> f64 {
    origin.elapsed_ms(e).unwrap() as f64
}

/// A kernel with few blocks (top-k over 8 rows of 4M logits: 8 blocks, each scanning its
/// row several times) on the compute stream, and a page copy from the host tier (pinned
/// host memory read over PCIe, 8192 blocks) on the copy stream, enqueued together. Alone
/// each takes `dk` and `dc`; together they must finish in clearly less than `dk + dc`
/// (at least a quarter of the shorter one hidden). The same pair on one stream is the
/// control: there nothing may overlap, which shows the measurement can tell.
#[test]
fn copy_stream_overlaps_compute() {
    conformance::run_check(
        "cuda",
        "copy_stream_overlaps_compute",
        || CudaBackend::new(0),
        overlap,
    );
}

fn overlap(b: &CudaBackend) -> Outcome {
    let compute = b.on_stream(StreamKind::Compute)?;
    let copy = b.on_stream(StreamKind::Copy)?;
    let mut rng = fixtures::case_rng(conformance::seed(), 77);

    // Top-k: 8 rows of 4M random logits, k = 2048, positions out.
    let (rows_n, stride, k) = (8usize, 4usize << 20, 2048usize);
    let logits: Vec<f32> = (0..rows_n * stride)
        .map(|_| fixtures::normal(&mut rng) as f32)
        .collect();
    let logits = compute.upload(fixtures::bytes_of(&logits))?;
    let rows: Vec<QueryRange> = (0..rows_n)
        .map(|_| QueryRange {
            request: 0,
            start: 0,
            end: stride as u32,
        })
        .collect();
    let topk = Topk {
        short_rows: sparsekit::host::ops::ShortRows::SelectValid,
        k,
        row_stride: stride,
        rows: &rows,
        output: TopkOutput::Positions,
    };
    let mut out = compute.alloc(rows_n * k * 4)?;

    // Page copy: 8192 fp8 index-K pages (DeepSeek-V3.2, 8448 B each) host tier → device.
    let layout = IndexKLayout::new(IndexKDtype::FP8, 128, 64)?;
    let n_pages = 8192usize;
    let region = PagedRegion::contiguous(layout, n_pages);
    let ids: Vec<i32> = (0..n_pages as i32).collect();
    let mut host = copy.alloc_host(layout.buffer_bytes(n_pages))?;
    let staging = copy.upload(&fixtures::garbage(&mut rng, layout.buffer_bytes(n_pages)))?;
    let fill = CopyPages {
        src: region,
        dst: region,
        src_ids: &ids,
        dst_ids: &ids,
    };
    copy.copy_pages(&fill, &staging, &mut host)?;
    let mut device_pool = copy.alloc(layout.buffer_bytes(n_pages))?;
    compute.synchronize()?;
    copy.synchronize()?;

    let run_topk = |h: &CudaBackend, out: &mut CudaBuffer| h.topk(&topk, &logits, out);
    let run_copy = |h: &CudaBackend, dst: &mut CudaBuffer| h.copy_pages(&fill, &host, dst);

    // Warm-up (module load, first-launch costs), then each alone.
    run_topk(&compute, &mut out)?;
    run_copy(&copy, &mut device_pool)?;
    compute.synchronize()?;
    copy.synchronize()?;
    let t0 = compute.record_timing_event()?;
    run_topk(&compute, &mut out)?;
    let t1 = compute.record_timing_event()?;
    compute.synchronize()?;
    let dk = at(&t0, &t1);
    let t0 = copy.record_timing_event()?;
    run_copy(&copy, &mut device_pool)?;
    let t1 = copy.record_timing_event()?;
    copy.synchronize()?;
    let dc = at(&t0, &t1);

    // Together: the second handle starts once the compute stream reached the origin; the
    // makespan is the later of the two ends.
    let mut together = |second: &CudaBackend| -> sparsekit::host::Result<f64> {
        let origin = compute.record_timing_event()?;
        second.wait_event(&compute.record_event()?)?;
        run_topk(&compute, &mut out)?;
        let k_end = compute.record_timing_event()?;
        run_copy(second, &mut device_pool)?;
        let c_end = second.record_timing_event()?;
        compute.synchronize()?;
        second.synchronize()?;
        Ok(at(&origin, &k_end).max(at(&origin, &c_end)))
    };
    let mut overlapped = f64::INFINITY;
    for _ in 0..3 {
        overlapped = overlapped.min(together(&copy)?);
    }
    let serial = together(&compute)?;
    let hidden = dk + dc - overlapped;
    eprintln!(
        "topk alone {dk:.3} ms, copy alone {dc:.3} ms; on two streams {overlapped:.3} ms \
         ({hidden:.3} ms hidden); on one stream {serial:.3} ms"
    );
    ensure(dk > 0.2 && dc > 0.2, || {
        format!("work too short to measure: topk {dk:.3} ms, copy {dc:.3} ms")
    })?;
    ensure(serial > 0.9 * (dk + dc), || {
        format!("one stream took {serial:.3} ms < 0.9 × ({dk:.3} + {dc:.3}): timing unusable")
    })?;
    ensure(hidden >= 0.25 * dk.min(dc), || {
        format!("no overlap: two streams took {overlapped:.3} ms for {dk:.3} + {dc:.3} ms of work")
    })
}

/// The GPU dense kernels of the model give the CPU backend's bits for every op (the same
/// operation sequence per element; see `sparsekit_host::model_ops`), at sizes that cut
/// the matmul's tiles mid-way and cross its staged `k` chunks.
#[test]
fn dense_ops_give_the_cpu_bits() {
    conformance::run_check(
        "cuda",
        "dense_ops_give_the_cpu_bits",
        || CudaBackend::new(0),
        |cuda| {
            let mut rng = fixtures::case_rng(conformance::seed(), 91);
            let inputs = DenseInputs::new(&mut rng);
            let want = dense_outputs(&sparsekit::host::CpuBackend::new(), &inputs)?;
            let got = dense_outputs(cuda, &inputs)?;
            for ((name, w), (_, g)) in want.iter().zip(&got) {
                ensure(w == g, || format!("{name}: cuda differs from cpu"))?;
            }
            Ok(())
        },
    );
}

/// Random operands of [`dense_outputs`] (non-finite values where the op defines them).
struct DenseInputs {
    x: Vec<f32>,
    w: Vec<f32>,
    gu: Vec<f32>,
    logits: Vec<f32>,
    /// Rows of the `[D_ROWS, D_VOCAB]` logits gathered as embeddings.
    tokens: Vec<u32>,
    /// `gated_pool`: `[D_ROWS, 2·D_N]` values and gate logits (logits spread wide, so
    /// weights underflow), `[D_SPAN, D_N]` bias, `[D_ENTRIES, D_SPAN]` ragged sources.
    /// Finite only: a NaN output's payload bits differ between CPU and GPU, and the
    /// comparison here is of bytes.
    pool_x: Vec<f32>,
    pool_bias: Vec<f32>,
    pool_sources: Vec<u32>,
}

const D_ROWS: usize = 13;
const D_K: usize = 300;
const D_N: usize = 130;
const D_VOCAB: usize = 1000;
const D_SPAN: usize = 8;
const D_ENTRIES: usize = 11;

impl DenseInputs {
    fn new(rng: &mut fixtures::SuiteRng) -> Self {
        let mut v = |n: usize, s: f64| -> Vec<f32> {
            (0..n).map(|_| (fixtures::normal(rng) * s) as f32).collect()
        };
        let x = v(D_ROWS * D_K, 1.0);
        let w = v(D_K * D_N, 0.1);
        let mut gu = v(D_ROWS * 2 * D_N, 30.0);
        gu[0] = f32::NAN;
        gu[1] = f32::INFINITY;
        let mut logits = v(D_ROWS * D_VOCAB, 1.0);
        logits[7] = 50.0;
        logits[900] = 50.0;
        logits[D_VOCAB + 500] = f32::NAN;
        let tokens = (0..2 * D_ROWS as u32)
            .map(|i| (i * 7) % D_ROWS as u32)
            .collect();
        let mut pool_x = v(D_ROWS * 2 * D_N, 1.0);
        for r in 0..D_ROWS {
            for g in &mut pool_x[(2 * r + 1) * D_N..(2 * r + 2) * D_N] {
                *g *= 25.0;
            }
        }
        let pool_bias = v(D_SPAN * D_N, 10.0);
        // Entry e keeps slot i when (e + i) % 3 != 1, and always slot e % D_SPAN: ragged
        // counts with holes in the middle, never an entry without a valid slot.
        let pool_sources = (0..D_ENTRIES * D_SPAN)
            .map(|k| {
                let (e, i) = (k / D_SPAN, k % D_SPAN);
                if (e + i) % 3 != 1 || i == e % D_SPAN {
                    rand::Rng::gen_range(rng, 0..D_ROWS as u32)
                } else {
                    sparsekit::host::model_ops::GatedPool::EMPTY
                }
            })
            .collect();
        DenseInputs {
            x,
            w,
            gu,
            logits,
            tokens,
            pool_x,
            pool_bias,
            pool_sources,
        }
    }
}

/// Runs each dense op once on `b` and returns each output's bytes by op name.
fn dense_outputs<B: sparsekit::host::ModelOps>(
    b: &B,
    i: &DenseInputs,
) -> Result<Vec<(&'static str, Vec<u8>)>, sparsekit::host::Error> {
    use sparsekit::host::model_ops::{
        rope_table, Accumulate, Add, Argmax, Cast, DenseDtype, Embed, GatedPool, Matmul, RmsNorm,
        Rope, SwiGlu, View,
    };
    let f = |v: &[f32]| b.upload(fixtures::bytes_of(v));
    let (rows, k, n) = (D_ROWS, D_K, D_N);
    let x = f(&i.x)?;
    let mut out = Vec::new();
    let mut mm = b.upload(&vec![0x7f; rows * n * 4])?;
    b.matmul(&Matmul::dense(rows, k, n), &x, &f(&i.w)?, &mut mm)?;
    out.push(("matmul", b.download(&mm)?));
    let acc = Matmul {
        accumulate: Accumulate::Add,
        ..Matmul::dense(rows, k, n)
    };
    b.matmul(&acc, &x, &f(&i.w)?, &mut mm)?;
    out.push(("matmul add", b.download(&mm)?));
    let mut nrm = b.alloc(rows * k * 4)?;
    let norm = RmsNorm {
        rows,
        width: k,
        eps: 1e-6,
        x: View::dense(k),
        out: View::dense(k),
    };
    b.rms_norm(&norm, &x, &f(&i.w[..k])?, &mut nrm)?;
    out.push(("rms_norm", b.download(&nrm)?));
    let positions: Vec<u32> = (0..rows as u32).map(|r| r * 11).collect();
    let rope = Rope {
        heads: 5,
        rope_dim: 60,
        positions: &positions,
        max_positions: 200,
        x: View::grouped(5, 60),
        out: View::grouped(5, 60),
    };
    let mut ro = b.alloc(rows * 300 * 4)?;
    b.rope(&rope, &f(&rope_table(60, 200, 10000.0))?, &x, &mut ro)?;
    out.push(("rope", b.download(&ro)?));
    let mut sw = b.alloc(rows * n * 4)?;
    b.swiglu(&SwiGlu { rows, width: n }, &f(&i.gu)?, &mut sw)?;
    out.push(("swiglu", b.download(&sw)?));
    // The logits as a [rows, vocab] embedding table.
    let embed = Embed {
        vocab: rows,
        dim: D_VOCAB,
        tokens: &i.tokens,
    };
    let mut em = b.alloc(i.tokens.len() * D_VOCAB * 4)?;
    b.embed(&embed, &f(&i.logits)?, &mut em)?;
    out.push(("embed", b.download(&em)?));
    let mut ad = f(&i.x)?;
    let add = Add {
        rows,
        width: k,
        x: View::dense(k),
        acc: View::dense(k),
    };
    b.add(&add, &nrm, &mut ad)?;
    out.push(("add", b.download(&ad)?));
    let cast = Cast {
        rows,
        groups: 1,
        width: k,
        from: DenseDtype::F32,
        to: DenseDtype::Bf16,
        x: View::dense(k),
        out: View::dense(k),
    };
    let mut c16 = b.alloc(rows * k * 2)?;
    b.cast(&cast, &ad, &mut c16)?;
    out.push(("cast", b.download(&c16)?));
    let mut am = b.alloc(rows * 4)?;
    b.argmax(
        &Argmax {
            rows,
            width: D_VOCAB,
        },
        &f(&i.logits)?,
        &mut am,
    )?;
    out.push(("argmax", b.download(&am)?));
    let pool = GatedPool {
        entries: D_ENTRIES,
        span: D_SPAN,
        width: n,
        sources: &i.pool_sources,
        rows,
    };
    let mut gp = b.upload(&vec![0x7f; D_ENTRIES * n * 4])?;
    b.gated_pool(&pool, &f(&i.pool_x)?, &f(&i.pool_bias)?, &mut gp)?;
    out.push(("gated_pool", b.download(&gp)?));
    Ok(out)
}
