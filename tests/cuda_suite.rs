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
