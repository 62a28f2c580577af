//! The nvptx64 implementation of [`Simt`] (the entry points are declared with the typed
//! kernel interface in [`crate::launch`]).
//!
//! Built by the root build script once per SM arch with `-C target-cpu=sm_XX`; rustc then
//! sets `cfg(target_feature = "sm_XX")` for that arch and every lower one (sm_90 implies
//! sm_89), which selects arch-specific code such as the e4m3 mma (sm_89+).

use core::arch::asm;
use core::arch::nvptx;

use crate::simt::Simt;

/// The GPU itself.
#[derive(Clone, Copy, Debug, Default)]
pub struct Device;

macro_rules! shfl {
    ($mode:literal, $clamp:literal, $mask:expr, $v:expr, $b:expr) => {{
        let r: u32;
        // SAFETY: a warp shuffle has no memory effects; the `.sync` mask contract is the
        // caller's (see `Simt`).
        unsafe {
            asm!(
                concat!("shfl.sync.", $mode, ".b32 {r}, {v}, {b}, ", $clamp, ", {m};"),
                r = out(reg32) r,
                v = in(reg32) $v,
                b = in(reg32) $b,
                m = in(reg32) $mask,
                options(nomem, nostack, preserves_flags),
            );
        }
        r
    }};
}

impl Simt for Device {
    const HAS_FP8_MMA: bool = cfg!(target_feature = "sm_89");

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
        let base = core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<u8>();
        // SAFETY: in bounds and aligned (caller's contract).
        unsafe { base.add(byte_offset).cast::<T>().read() }
    }
    #[inline(always)]
    unsafe fn smem_store<T: Copy>(byte_offset: usize, value: T) {
        let base = core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<u8>();
        // SAFETY: in bounds and aligned (caller's contract).
        unsafe { base.add(byte_offset).cast::<T>().write(value) }
    }
    #[inline(always)]
    unsafe fn smem_atomic_add_u32(byte_offset: usize, value: u32) -> u32 {
        let base = core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<u8>();
        let p = base.wrapping_add(byte_offset);
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
        shfl!("bfly", "0x1f", mask, value, lane_mask)
    }
    #[inline(always)]
    fn shfl_idx(mask: u32, value: u32, src_lane: u32) -> u32 {
        shfl!("idx", "0x1f", mask, value, src_lane)
    }
    #[inline(always)]
    fn shfl_down(mask: u32, value: u32, delta: u32) -> u32 {
        shfl!("down", "0x1f", mask, value, delta)
    }
    #[inline(always)]
    fn ballot(mask: u32, predicate: bool) -> u32 {
        let r: u32;
        // SAFETY: a warp vote has no memory effects.
        unsafe {
            asm!(
                "{{ .reg .pred p; setp.ne.u32 p, {x}, 0; vote.sync.ballot.b32 {r}, p, {m}; }}",
                r = out(reg32) r,
                x = in(reg32) predicate as u32,
                m = in(reg32) mask,
                options(nomem, nostack, preserves_flags),
            );
        }
        r
    }
    #[inline(always)]
    unsafe fn atomic_add_u32(ptr: *mut u32, value: u32) -> u32 {
        let r: u32;
        // SAFETY: `ptr` is valid global memory (caller's contract).
        unsafe {
            asm!(
                "atom.global.add.u32 {r}, [{p}], {v};",
                r = out(reg32) r,
                p = in(reg64) ptr,
                v = in(reg32) value,
                options(nostack, preserves_flags),
            );
        }
        r
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
                options(pure, nomem, nostack, preserves_flags),
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
                    options(pure, nomem, nostack, preserves_flags),
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
}
