//! Timing benchmark of the host SIMT emulator (prints only; asserts nothing about time).
//!
//! Run with
//! `cargo test -p sparsekit-kernels --features emu --release --test emu_bench -- --ignored --nocapture`.
#![cfg(feature = "emu")]
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use std::time::{Duration, Instant};

use sparsekit_kernels::emu::{launch, Emu, LaunchConfig, Params};
use sparsekit_kernels::global::{GlobalMut, GlobalPtr};
use sparsekit_kernels::kernels;
use sparsekit_kernels::params::PageChecksumsParams;
use sparsekit_kernels::simt::Simt;

fn cfg(grid: u32, block: u32, dyn_smem_bytes: usize) -> LaunchConfig {
    LaunchConfig {
        grid,
        block,
        dyn_smem_bytes,
    }
}

/// Runs `f` `reps` times (after one warm-up run) and prints the mean time per run.
fn time(name: &str, reps: u32, mut f: impl FnMut()) -> Duration {
    f();
    let start = Instant::now();
    for _ in 0..reps {
        f();
    }
    let per = start.elapsed() / reps;
    println!("emu bench: {name:<48} {:>10.3} ms", per.as_secs_f64() * 1e3);
    per
}

#[derive(Clone, Copy)]
struct OutArgs {
    out: *mut u32,
}

/// `rounds` butterfly shuffles per warp; each lane writes its final value.
///
/// # Safety
/// `out` holds one u32 per thread of the grid.
unsafe fn shuffle_kernel<S: Simt>(p: OutArgs, rounds: u32) {
    let mut v = S::global_idx();
    for r in 0..rounds {
        v = v.wrapping_add(S::shfl_xor(u32::MAX, v, 1 << (r % 5)));
    }
    // SAFETY: one slot per thread.
    unsafe { *p.out.add(S::global_idx() as usize) = v };
}

/// `rounds` barriers, each after a store to the thread's own shared slot.
///
/// # Safety
/// Dynamic shared memory holds one u32 per thread.
unsafe fn barrier_kernel<S: Simt>(rounds: u32) {
    let t = S::thread_idx();
    for r in 0..rounds {
        // SAFETY: own slot.
        unsafe { S::smem_store(4 * t as usize, r) };
        S::sync_threads();
    }
}

#[test]
#[ignore = "benchmark: run explicitly with --ignored --nocapture"]
fn emu_launch_and_collective_timings() {
    time("empty launch, 1 x 128 threads", 50, || {
        launch(cfg(1, 128, 0), || {}).unwrap();
    });
    time("empty launch, 1 x 1024 threads", 20, || {
        launch(cfg(1, 1024, 0), || {}).unwrap();
    });
    time("empty launch, 64 x 128 threads", 10, || {
        launch(cfg(64, 128, 0), || {}).unwrap();
    });

    let mut out = vec![0u32; 256];
    // SAFETY: one slot per thread.
    let args = unsafe {
        Params::new(OutArgs {
            out: out.as_mut_ptr(),
        })
    };
    time("1000 shfl_xor per warp, 1 x 256 threads", 3, || {
        // SAFETY: `out` holds one slot per thread.
        launch(cfg(1, 256, 0), || unsafe {
            shuffle_kernel::<Emu>(args.get(), 1000)
        })
        .unwrap();
    });
    let mut out = vec![0u32; 64 * 128];
    // SAFETY: one slot per thread.
    let args = unsafe {
        Params::new(OutArgs {
            out: out.as_mut_ptr(),
        })
    };
    time("20 shfl_xor per warp, 64 x 128 threads", 5, || {
        // SAFETY: `out` holds one slot per thread.
        launch(cfg(64, 128, 0), || unsafe {
            shuffle_kernel::<Emu>(args.get(), 20)
        })
        .unwrap();
    });
    time("100 barriers, 1 x 256 threads", 3, || {
        // SAFETY: smem holds one u32 per thread.
        launch(cfg(1, 256, 4 * 256), || unsafe {
            barrier_kernel::<Emu>(100)
        })
        .unwrap();
    });

    // page_checksums over 64 pages of 4 KiB.
    let (n_pages, page) = (64u32, 4096usize);
    let pool: Vec<u8> = (0..n_pages as usize * page)
        .map(|i| (i * 7 + 3) as u8)
        .collect();
    let ids: Vec<i32> = (0..n_pages as i32).rev().collect();
    let mut sums = vec![0u64; n_pages as usize];
    // SAFETY: pages lie in `pool`, one output per page; all outlive the launches.
    let p = unsafe {
        Params::new(PageChecksumsParams {
            pool: GlobalPtr::from_raw(pool.as_ptr()),
            ids: GlobalPtr::from_raw(ids.as_ptr()),
            out: GlobalMut::from_raw(sums.as_mut_ptr()),
            stride: page as u64,
            bytes: page as u64,
            n_pages,
            _pad: 0,
        })
    };
    time("page_checksums, 64 pages x 4 KiB, 64 x 256", 3, || {
        // SAFETY: the kernel's contract: block of 8 warps, 8 * 8 bytes of shared memory.
        launch(cfg(n_pages, 256, 8 * 8), || unsafe {
            kernels::page_checksums::<Emu>(p.get())
        })
        .unwrap();
    });
    assert!(sums.iter().any(|&s| s != 0));
}
