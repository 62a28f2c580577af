//! The emulator's two carriers (fibers and pool threads) must agree: same results, same
//! misuse reports, and forward progress for threads that wait on each other through
//! atomics. (`emu_selftest.rs` runs on the default carrier; set
//! `SPARSEKIT_EMU_CARRIER=threads` to run it on pool threads.)
#![cfg(feature = "emu")]
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use sparsekit_kernels::emu::{launch_with, Carrier, Emu, EmuError, LaunchConfig, Params, RaceKind};
use sparsekit_kernels::global::GlobalMut;
use sparsekit_kernels::simt::{warp_mask, Simt};

const CARRIERS: [Carrier; 2] = [Carrier::Fibers, Carrier::Threads];

/// Runs a launch on its own thread and fails the test instead of hanging.
fn run(
    carrier: Carrier,
    cfg: LaunchConfig,
    kernel: impl Fn() + Sync + Send + 'static,
) -> Result<(), EmuError> {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(launch_with(carrier, cfg, kernel));
    });
    rx.recv_timeout(Duration::from_secs(120))
        .expect("emulated launch did not return within 120 s")
}

fn cfg(grid: u32, block: u32, dyn_smem_bytes: usize) -> LaunchConfig {
    LaunchConfig {
        grid,
        block,
        dyn_smem_bytes,
    }
}

#[derive(Clone, Copy)]
struct OutArgs {
    out: *mut u32,
}

/// Per thread: a warp butterfly sum, then a block sum through shared memory and barriers,
/// then a shuffle of the block sum from a rotating lane, written to `out[global_idx]`.
///
/// # Safety
/// `out` holds one u32 per thread of the grid; shared memory holds 32 u32.
unsafe fn mixed_kernel<S: Simt>(p: OutArgs) {
    let (t, lane, warp) = (S::thread_idx(), S::lane_id(), S::warp_id());
    let mask = warp_mask(S::block_dim(), warp);
    let x = S::global_idx() * 7 + 1;
    let mut sum = x;
    let mut offset = 16;
    while offset > 0 {
        let other = S::shfl_down(mask, sum, offset);
        if lane + offset < mask.count_ones() {
            sum = sum.wrapping_add(other);
        }
        offset /= 2;
    }
    if lane == 0 {
        // SAFETY: slot `warp` < 32.
        unsafe { S::smem_store(4 * warp as usize, sum) };
    }
    S::sync_threads();
    let mut total = 0u32;
    for w in 0..S::block_dim().div_ceil(32) {
        // SAFETY: written by warp w's lane 0 before the barrier.
        total = total.wrapping_add(unsafe { S::smem_load::<u32>(4 * w as usize) });
    }
    let src = (S::block_idx() + 3) % mask.count_ones();
    let v = S::shfl_idx(mask, total.wrapping_add(t), src);
    // SAFETY: one slot per thread.
    unsafe { *p.out.add(S::global_idx() as usize) = v };
}

fn mixed_expected(grid: u32, block: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for b in 0..grid {
        let total = (b * block..(b + 1) * block).fold(0u32, |a, g| a.wrapping_add(g * 7 + 1));
        for t in 0..block {
            let warp_base = t - t % 32;
            let active = warp_mask(block, t / 32).count_ones();
            let src = (b + 3) % active;
            out.push(total.wrapping_add(warp_base + src));
        }
    }
    out
}

#[test]
fn carriers_compute_the_same_results() {
    for carrier in CARRIERS {
        for (grid, block) in [(3u32, 32u32), (2, 100), (2, 256), (2, 1024), (40, 64)] {
            let mut out = vec![0u32; (grid * block) as usize];
            // SAFETY: one slot per thread.
            let args = unsafe {
                Params::new(OutArgs {
                    out: out.as_mut_ptr(),
                })
            };
            // SAFETY: `out` holds one slot per thread; smem holds 32 u32.
            run(carrier, cfg(grid, block, 128), move || unsafe {
                mixed_kernel::<Emu>(args.get())
            })
            .unwrap();
            assert_eq!(
                out,
                mixed_expected(grid, block),
                "{carrier:?}, {grid} x {block}"
            );
        }
    }
}

/// Misuse scenarios (a subset of the self-tests').
///
/// # Safety
/// Shared-memory scenarios are deliberately wrong; the emulator stops them.
unsafe fn misuse_kernel<S: Simt>(scenario: u32) {
    let t = S::thread_idx();
    let lane = S::lane_id();
    match scenario {
        0 => {
            if t % 2 == 1 {
                return;
            }
            S::sync_threads();
        }
        1 => {
            if lane < 8 {
                S::sync_threads();
            }
            let _ = S::shfl_xor(u32::MAX, t, 1);
            if lane >= 8 {
                S::sync_threads();
            }
        }
        2 => {
            if t == 3 {
                // SAFETY: in bounds.
                let _ = unsafe { S::smem_load::<u32>(8) };
            }
            S::sync_threads();
            if t == 3 {
                // SAFETY: in bounds.
                let _ = unsafe { S::smem_load::<u32>(8) };
            }
            let _ = S::shfl_xor(u32::MAX, t, 1);
            if t == 4 {
                // SAFETY: in bounds.
                unsafe { S::smem_store(8, 1u32) };
            }
        }
        3 => {
            if S::block_idx() == 2 && t == 70 {
                panic!("boom");
            }
            S::sync_threads();
            let _ = S::ballot(warp_mask(S::block_dim(), S::warp_id()), true);
        }
        4 => {
            if lane == 31 {
                return;
            }
            let _ = S::shfl_xor(u32::MAX, t, 1);
        }
        5 => {
            S::sync_threads();
            if t == 200 {
                // SAFETY: deliberately out of bounds; the emulator stops it.
                unsafe { S::smem_store(256, 1u32) };
            }
        }
        _ => unreachable!(),
    }
}

#[test]
fn carriers_report_the_same_misuse() {
    for carrier in CARRIERS {
        let misuse = |cfg: LaunchConfig, scenario: u32| {
            // SAFETY: the scenarios use no global memory.
            run(carrier, cfg, move || unsafe {
                misuse_kernel::<Emu>(scenario)
            })
            .expect_err("the emulator must report this kernel")
        };
        assert_eq!(
            misuse(cfg(2, 128, 0), 0),
            EmuError::BarrierDivergence {
                block: 0,
                waiting: 64,
                exited: 64
            },
            "{carrier:?}"
        );
        match misuse(cfg(1, 64, 0), 1) {
            EmuError::WarpCollective {
                block: 0,
                warp: 0,
                detail,
            } if detail.contains("sync_threads") => {}
            e => panic!("{carrier:?}: {e}"),
        }
        assert_eq!(
            misuse(cfg(1, 64, 64), 2),
            EmuError::SharedRace {
                block: 0,
                offset: 8,
                first_thread: 3,
                second_thread: 4,
                kind: RaceKind::WriteAfterRead
            },
            "{carrier:?}"
        );
        assert_eq!(
            misuse(cfg(4, 96, 0), 3),
            EmuError::KernelPanic {
                block: 2,
                thread: 70,
                message: "boom".to_string()
            },
            "{carrier:?}"
        );
        match misuse(cfg(1, 32, 0), 4) {
            EmuError::WarpCollective {
                block: 0,
                warp: 0,
                detail,
            } if detail.contains("returned from the kernel") => {}
            e => panic!("{carrier:?}: {e}"),
        }
        assert_eq!(
            misuse(cfg(1, 256, 256), 5),
            EmuError::SharedOutOfBounds {
                block: 0,
                thread: 200,
                offset: 256,
                size: 4,
                smem_bytes: 256
            },
            "{carrier:?}"
        );
    }
}

#[derive(Clone, Copy)]
struct FlagArgs {
    flags: *mut u32,
}

/// Every thread but the last of each block spins on the block's flag, which the last
/// thread raises: the threads must run concurrently (or take turns).
///
/// # Safety
/// `flags` holds one u32 per block, accessed only atomically.
unsafe fn spin_kernel<S: Simt>(p: FlagArgs) {
    // SAFETY: one flag per block.
    let flag = GlobalMut::from_raw(unsafe { p.flags.add(S::block_idx() as usize) });
    if S::thread_idx() == S::block_dim() - 1 {
        // SAFETY: valid, only accessed atomically.
        unsafe { S::atomic_add_u32(flag, 1) };
        return;
    }
    // SAFETY: as above.
    while unsafe { S::atomic_add_u32(flag, 0) } == 0 {}
}

#[test]
fn threads_spinning_on_atomics_make_progress() {
    for carrier in CARRIERS {
        let grid = 3u32;
        let mut flags = vec![0u32; grid as usize];
        // SAFETY: the flags are only accessed atomically.
        let args = unsafe {
            Params::new(FlagArgs {
                flags: flags.as_mut_ptr(),
            })
        };
        // SAFETY: one flag per block.
        run(carrier, cfg(grid, 128, 0), move || unsafe {
            spin_kernel::<Emu>(args.get())
        })
        .unwrap();
        assert_eq!(flags, [1; 3], "{carrier:?}");
    }
}

#[test]
fn concurrent_launches_on_both_carriers() {
    let handles: Vec<_> = (0..6)
        .map(|i| {
            thread::spawn(move || {
                let carrier = CARRIERS[i % 2];
                for round in 0..10u32 {
                    let (grid, block) = (1 + round % 3, [32u32, 96, 256][i % 3]);
                    let mut out = vec![0u32; (grid * block) as usize];
                    // SAFETY: one slot per thread.
                    let args = unsafe {
                        Params::new(OutArgs {
                            out: out.as_mut_ptr(),
                        })
                    };
                    // SAFETY: `out` holds one slot per thread; smem holds 32 u32.
                    launch_with(carrier, cfg(grid, block, 128), move || unsafe {
                        mixed_kernel::<Emu>(args.get())
                    })
                    .unwrap();
                    assert_eq!(out, mixed_expected(grid, block), "{carrier:?}");
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

#[test]
fn launch_inside_a_kernel_restores_the_outer_thread() {
    for outer in CARRIERS {
        for inner in CARRIERS {
            let mut out = vec![0u32; 64];
            // SAFETY: one slot per outer thread.
            let args = unsafe {
                Params::new(OutArgs {
                    out: out.as_mut_ptr(),
                })
            };
            let kernel = move || {
                let t = Emu::thread_idx();
                let mut inner_out = vec![0u32; 2 * 32];
                if t % 16 == 0 {
                    // SAFETY: one slot per inner thread.
                    let inner_args = unsafe {
                        Params::new(OutArgs {
                            out: inner_out.as_mut_ptr(),
                        })
                    };
                    // SAFETY: `inner_out` holds one slot per thread; smem 32 u32.
                    launch_with(inner, cfg(2, 32, 128), move || unsafe {
                        mixed_kernel::<Emu>(inner_args.get())
                    })
                    .unwrap();
                    assert_eq!(inner_out, mixed_expected(2, 32));
                }
                let v = Emu::shfl_xor(u32::MAX, t, 1);
                // SAFETY: one slot per thread.
                unsafe { *args.get().out.add(Emu::global_idx() as usize) = v };
            };
            run(outer, cfg(1, 64, 0), kernel).unwrap();
            let expected: Vec<u32> = (0..64).map(|t| t ^ 1).collect();
            assert_eq!(out, expected, "outer {outer:?}, inner {inner:?}");
        }
    }
}

/// Recurses until the stack overflows.
#[inline(never)]
fn recurse(depth: u64) -> u64 {
    let buf = std::hint::black_box([depth; 64]);
    if buf[0] == u64::MAX {
        return 0;
    }
    recurse(depth + 1).wrapping_add(buf[7])
}

/// Not a test on its own: the process that `fiber_stack_overflow_faults` runs.
#[test]
#[ignore = "overflows a fiber stack; run by fiber_stack_overflow_faults"]
fn stack_overflow_child() {
    let r = launch_with(Carrier::Fibers, cfg(1, 32, 0), || {
        std::hint::black_box(recurse(0));
    });
    println!("launch returned {r:?}");
}

#[test]
fn fiber_stack_overflow_faults() {
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .args([
            "--ignored",
            "--exact",
            "stack_overflow_child",
            "--nocapture",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !out.status.success() && !stdout.contains("launch returned"),
        "a stack overflow in a kernel must kill the process: {:?}\n{stdout}",
        out.status
    );
}
