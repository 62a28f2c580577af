//! The nvptx64 implementation of [`Simt`] (the entry points are declared with the typed
//! kernel interface in [`crate::launch`]).
//!
//! Built by the root build script once per SM arch with `-C target-cpu=sm_XX`; rustc then
//! sets `cfg(target_feature = "sm_XX")` for that arch and every lower one (sm_90 implies
//! sm_89), which selects arch-specific code such as the e4m3 mma (sm_89+).
//!
//! # Warp-wide instructions and the optimiser
//!
//! An instruction every lane of a warp must execute together (`shfl.sync`, `vote.sync`,
//! `mma.sync.aligned`, `bar.sync`) must never be moved into, or duplicated across,
//! lane-divergent control flow; LLVM guarantees that only for calls it knows to be
//! `convergent`. So: barriers, shuffles and votes are the NVVM intrinsics (declared
//! `convergent` by LLVM); `mma.sync` has no convergent intrinsic (LLVM's mma intrinsics
//! are plain `memory(none)`), so it is inline asm that (a) is not `pure` (never sunk,
//! hoisted, speculated or merged) and (b) is marked `convergent` by the root build script
//! in the unoptimised IR, before any LLVM pass runs (`build.rs`: rustc emits the IR with
//! `-C no-prepopulate-passes`, the script marks every warp-wide asm call and then runs
//! the O3 pipeline itself). The build then checks, per function, that every warp-wide
//! instruction of the PTX is one the optimised IR issues, all of them convergent.

/// The NVVM intrinsics behind the warp collectives (LLVM declares them `convergent`).
#[allow(improper_ctypes)]
extern "unadjusted" {
    #[link_name = "llvm.nvvm.shfl.sync.bfly.i32"]
    fn shfl_sync_bfly(mask: u32, value: u32, lane_mask: u32, clamp: u32) -> u32;
    #[link_name = "llvm.nvvm.shfl.sync.idx.i32"]
    fn shfl_sync_idx(mask: u32, value: u32, src_lane: u32, clamp: u32) -> u32;
    #[link_name = "llvm.nvvm.shfl.sync.down.i32"]
    fn shfl_sync_down(mask: u32, value: u32, delta: u32, clamp: u32) -> u32;
    #[link_name = "llvm.nvvm.vote.ballot.sync"]
    fn vote_ballot_sync(mask: u32, predicate: bool) -> u32;
}

/// The block's dynamic shared memory, declared 16-byte aligned (`.extern .shared .align
/// 16`): the kernels issue 16-byte shared accesses relative to it.
#[inline(always)]
fn dyn_smem() -> *mut u8 {
    core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<crate::global::V4>().cast::<u8>()
}

use core::arch::asm;
use core::arch::nvptx;

use crate::global::{GlobalMut, GlobalPtr, Word};
use crate::simt::Simt;

/// The GPU itself.
#[derive(Clone, Copy, Debug, Default)]
pub struct Device;

impl Simt for Device {
    const HAS_FP8_MMA: bool = cfg!(target_feature = "sm_89");
    const HAS_MXF8_MMA: bool = cfg!(target_feature = "sm_120a");

    #[inline(always)]
    fn thread_idx() -> u32 {
        // SAFETY: reads a special register.
        unsafe { nvptx::_thread_idx_x() as u32 }
    }
    #[inline(always)]
    fn block_idx() -> u32 {
        // SAFETY: reads a special register.
        unsafe { nvptx::_block_idx_x() as u32 }
    }
    #[inline(always)]
    fn block_dim() -> u32 {
        // SAFETY: reads a special register.
        unsafe { nvptx::_block_dim_x() as u32 }
    }
    #[inline(always)]
    fn grid_dim() -> u32 {
        // SAFETY: reads a special register.
        unsafe { nvptx::_grid_dim_x() as u32 }
    }
    #[inline(always)]
    fn sync_threads() {
        // SAFETY: `bar.sync 0`; every thread of the block reaches it (kernel contract).
        unsafe { nvptx::_syncthreads() }
    }
    #[inline(always)]
    unsafe fn smem_load<T: Copy>(byte_offset: usize) -> T {
        // SAFETY: in bounds and aligned (caller's contract).
        unsafe { dyn_smem().add(byte_offset).cast::<T>().read() }
    }
    #[inline(always)]
    unsafe fn smem_store<T: Copy>(byte_offset: usize, value: T) {
        // SAFETY: in bounds and aligned (caller's contract).
        unsafe { dyn_smem().add(byte_offset).cast::<T>().write(value) }
    }
    #[inline(always)]
    unsafe fn smem_atomic_add_u32(byte_offset: usize, value: u32) -> u32 {
        let p = dyn_smem().wrapping_add(byte_offset);
        let r: u32;
        // SAFETY: `p` is an aligned u32 inside dynamic shared memory (caller's contract);
        // a generic-address atomic reaches the shared window.
        unsafe {
            asm!(
                "atom.add.u32 {r}, [{p}], {v};",
                r = out(reg32) r,
                p = in(reg64) p,
                v = in(reg32) value,
                options(nostack, preserves_flags),
            );
        }
        r
    }
    #[inline(always)]
    fn shfl_xor(mask: u32, value: u32, lane_mask: u32) -> u32 {
        // SAFETY: a warp shuffle (convergent intrinsic); the `.sync` mask contract is the
        // caller's (see `Simt`). Clamp 0x1f: the whole warp is one segment.
        unsafe { shfl_sync_bfly(mask, value, lane_mask, 0x1f) }
    }
    #[inline(always)]
    fn shfl_idx(mask: u32, value: u32, src_lane: u32) -> u32 {
        // SAFETY: as `shfl_xor`.
        unsafe { shfl_sync_idx(mask, value, src_lane, 0x1f) }
    }
    #[inline(always)]
    fn shfl_down(mask: u32, value: u32, delta: u32) -> u32 {
        // SAFETY: as `shfl_xor`.
        unsafe { shfl_sync_down(mask, value, delta, 0x1f) }
    }
    #[inline(always)]
    fn ballot(mask: u32, predicate: bool) -> u32 {
        // SAFETY: a warp vote (convergent intrinsic); the mask contract is the caller's.
        unsafe { vote_ballot_sync(mask, predicate) }
    }
    #[inline(always)]
    unsafe fn gld<T: Word>(ptr: GlobalPtr<T>) -> T {
        let p = ptr.raw();
        // One `ld.global` of T's width (`Word`: size = alignment ∈ {1, 2, 4, 8, 16}; the
        // match folds at monomorphisation). The generic address is converted to the
        // global window first (`cvta.to.global`, free in SASS).
        // SAFETY (every arm): `p` is an aligned address inside a buffer of the launch
        // (caller's contract); the asm reads exactly `size_of::<T>()` bytes there and
        // writes only its output registers; `transmute_copy` reads `size_of::<T>()` bytes
        // of a value of that size, and every bit pattern is a valid `T` (`Word`).
        unsafe {
            match core::mem::size_of::<T>() {
                1 => {
                    let r: u32;
                    asm!(
                        "{{ .reg .u64 g; cvta.to.global.u64 g, {p}; ld.global.u8 {r}, [g]; }}",
                        p = in(reg64) p, r = out(reg32) r,
                        options(pure, readonly, nostack, preserves_flags),
                    );
                    core::mem::transmute_copy(&(r as u8))
                }
                2 => {
                    let r: u32;
                    asm!(
                        "{{ .reg .u64 g; cvta.to.global.u64 g, {p}; ld.global.u16 {r}, [g]; }}",
                        p = in(reg64) p, r = out(reg32) r,
                        options(pure, readonly, nostack, preserves_flags),
                    );
                    core::mem::transmute_copy(&(r as u16))
                }
                4 => {
                    let r: u32;
                    asm!(
                        "{{ .reg .u64 g; cvta.to.global.u64 g, {p}; ld.global.u32 {r}, [g]; }}",
                        p = in(reg64) p, r = out(reg32) r,
                        options(pure, readonly, nostack, preserves_flags),
                    );
                    core::mem::transmute_copy(&r)
                }
                8 => {
                    let r: u64;
                    asm!(
                        "{{ .reg .u64 g; cvta.to.global.u64 g, {p}; ld.global.u64 {r}, [g]; }}",
                        p = in(reg64) p, r = out(reg64) r,
                        options(pure, readonly, nostack, preserves_flags),
                    );
                    core::mem::transmute_copy(&r)
                }
                _ => {
                    let (a, b, c, d): (u32, u32, u32, u32);
                    asm!(
                        "{{ .reg .u64 g; cvta.to.global.u64 g, {p}; \
                         ld.global.v4.u32 {{{a}, {b}, {c}, {d}}}, [g]; }}",
                        p = in(reg64) p,
                        a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
                        options(pure, readonly, nostack, preserves_flags),
                    );
                    core::mem::transmute_copy(&[a, b, c, d])
                }
            }
        }
    }
    #[inline(always)]
    unsafe fn gst<T: Word>(ptr: GlobalMut<T>, value: T) {
        let p = ptr.raw();
        // One `st.global` of T's width (see `gld`).
        // SAFETY (every arm): `p` is an aligned address inside a buffer the launch writes,
        // owned by this thread (caller's contract); the asm writes exactly
        // `size_of::<T>()` bytes there; `transmute_copy` reads a value of that size.
        unsafe {
            match core::mem::size_of::<T>() {
                1 => {
                    let v: u8 = core::mem::transmute_copy(&value);
                    asm!(
                        "{{ .reg .u64 g; cvta.to.global.u64 g, {p}; st.global.u8 [g], {v}; }}",
                        p = in(reg64) p, v = in(reg32) v as u32,
                        options(nostack, preserves_flags),
                    );
                }
                2 => {
                    let v: u16 = core::mem::transmute_copy(&value);
                    asm!(
                        "{{ .reg .u64 g; cvta.to.global.u64 g, {p}; st.global.u16 [g], {v}; }}",
                        p = in(reg64) p, v = in(reg32) v as u32,
                        options(nostack, preserves_flags),
                    );
                }
                4 => {
                    let v: u32 = core::mem::transmute_copy(&value);
                    asm!(
                        "{{ .reg .u64 g; cvta.to.global.u64 g, {p}; st.global.u32 [g], {v}; }}",
                        p = in(reg64) p, v = in(reg32) v,
                        options(nostack, preserves_flags),
                    );
                }
                8 => {
                    let v: u64 = core::mem::transmute_copy(&value);
                    asm!(
                        "{{ .reg .u64 g; cvta.to.global.u64 g, {p}; st.global.u64 [g], {v}; }}",
                        p = in(reg64) p, v = in(reg64) v,
                        options(nostack, preserves_flags),
                    );
                }
                _ => {
                    let v: [u32; 4] = core::mem::transmute_copy(&value);
                    asm!(
                        "{{ .reg .u64 g; cvta.to.global.u64 g, {p}; \
                         st.global.v4.u32 [g], {{{a}, {b}, {c}, {d}}}; }}",
                        p = in(reg64) p,
                        a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2], d = in(reg32) v[3],
                        options(nostack, preserves_flags),
                    );
                }
            }
        }
    }
    #[inline(always)]
    unsafe fn atomic_add_u32(ptr: GlobalMut<u32>, value: u32) -> u32 {
        let r: u32;
        // SAFETY: `ptr` is an aligned u32 of a buffer the launch writes (caller's
        // contract).
        unsafe {
            asm!(
                "{{ .reg .u64 g; cvta.to.global.u64 g, {p}; atom.global.add.u32 {r}, [g], {v}; }}",
                r = out(reg32) r,
                p = in(reg64) ptr.raw(),
                v = in(reg32) value,
                options(nostack, preserves_flags),
            );
        }
        r
    }
    #[inline(always)]
    fn threadfence() {
        // SAFETY: a memory fence; no operands.
        unsafe { asm!("membar.gl;", options(nostack, preserves_flags)) };
    }
    #[inline(always)]
    fn mma_bf16_m16n8k16(a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4] {
        let (d0, d1, d2, d3): (f32, f32, f32, f32);
        // SAFETY: register-only warp instruction; all 32 lanes execute it (contract).
        unsafe {
            asm!(
                "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 \
                 {{{d0}, {d1}, {d2}, {d3}}}, {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, \
                 {{{c0}, {c1}, {c2}, {c3}}};",
                d0 = out(reg32) d0, d1 = out(reg32) d1, d2 = out(reg32) d2, d3 = out(reg32) d3,
                a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
                b0 = in(reg32) b[0], b1 = in(reg32) b[1],
                c0 = in(reg32) c[0], c1 = in(reg32) c[1], c2 = in(reg32) c[2], c3 = in(reg32) c[3],
                // Not `pure`: a warp-wide instruction is never moved or merged (see the
                // module docs; the build marks it `convergent`).
                options(nomem, nostack, preserves_flags),
            );
        }
        [d0, d1, d2, d3]
    }
    #[inline(always)]
    fn mma_e4m3_m16n8k32(a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4] {
        #[cfg(target_feature = "sm_89")]
        {
            let (d0, d1, d2, d3): (f32, f32, f32, f32);
            // SAFETY: register-only warp instruction; all 32 lanes execute it (contract).
            unsafe {
                asm!(
                    "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 \
                     {{{d0}, {d1}, {d2}, {d3}}}, {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, \
                     {{{c0}, {c1}, {c2}, {c3}}};",
                    d0 = out(reg32) d0, d1 = out(reg32) d1, d2 = out(reg32) d2, d3 = out(reg32) d3,
                    a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
                    b0 = in(reg32) b[0], b1 = in(reg32) b[1],
                    c0 = in(reg32) c[0], c1 = in(reg32) c[1], c2 = in(reg32) c[2], c3 = in(reg32) c[3],
                    // Not `pure` (see above).
                    options(nomem, nostack, preserves_flags),
                );
            }
            [d0, d1, d2, d3]
        }
        #[cfg(not(target_feature = "sm_89"))]
        {
            // No fp8 mma below sm_89: the instruction is never emitted there.
            let _ = (a, b, c);
            // SAFETY: aborts the kernel.
            unsafe { nvptx::trap() }
        }
    }
    #[inline(always)]
    fn mma_mxf8_e4m3_m16n8k32(
        a: [u32; 4],
        b: [u32; 2],
        c: [f32; 4],
        sfa: u32,
        sfb: u32,
    ) -> [f32; 4] {
        #[cfg(target_feature = "sm_120a")]
        {
            let (d0, d1, d2, d3): (f32, f32, f32, f32);
            // SAFETY: register-only warp instruction; all 32 lanes execute it (contract).
            unsafe {
                asm!(
                    "mma.sync.aligned.m16n8k32.row.col.kind::mxf8f6f4.block_scale.scale_vec::1X.\
                     f32.e4m3.e4m3.f32.ue8m0 \
                     {{{d0}, {d1}, {d2}, {d3}}}, {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, \
                     {{{c0}, {c1}, {c2}, {c3}}}, {sa}, {{0, 0}}, {sb}, {{0, 0}};",
                    d0 = out(reg32) d0, d1 = out(reg32) d1, d2 = out(reg32) d2, d3 = out(reg32) d3,
                    a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
                    b0 = in(reg32) b[0], b1 = in(reg32) b[1],
                    c0 = in(reg32) c[0], c1 = in(reg32) c[1], c2 = in(reg32) c[2], c3 = in(reg32) c[3],
                    sa = in(reg32) sfa, sb = in(reg32) sfb,
                    // Not `pure` (see above).
                    options(nomem, nostack, preserves_flags),
                );
            }
            [d0, d1, d2, d3]
        }
        #[cfg(not(target_feature = "sm_120a"))]
        {
            // Only sm_120a has the block-scaled mma: the instruction is never emitted
            // elsewhere (kernels take it only when `HAS_MXF8_MMA`).
            let _ = (a, b, c, sfa, sfb);
            // SAFETY: aborts the kernel.
            unsafe { nvptx::trap() }
        }
    }
}
