//! The SIMT vocabulary every kernel is written against (the names follow cuda_std).
//!
//! All methods are associated functions: an implementation is a zero-sized marker type
//! (`Device` on nvptx64, `Emu` in the host emulator), so everything inlines. Launches
//! are one-dimensional (`x` only). Kernels reach global memory only through the typed
//! addresses of their `#[repr(C)]` parameter structs ([`GlobalPtr`], [`GlobalMut`]) and
//! [`Simt::gld`]/[`Simt::gst`], which the emulator bounds-, alignment- and init-checks
//! against the launch's buffers; and shared memory only through
//! [`Simt::smem_load`]/[`Simt::smem_store`], which the emulator bounds- and race-checks.
//!
//! Warp collectives (`shfl_*`, `ballot`, `mma_*`) follow PTX `.sync` semantics: every lane
//! named in `mask` must execute the same collective, and `mask` must name only lanes that
//! are still running. The emulator reports violations instead of hanging.

use crate::global::{GlobalMut, GlobalPtr, Word};

/// One GPU thread's view of the machine.
pub trait Simt {
    /// Whether `mma_e4m3_m16n8k32` exists (sm_89 and newer; always in the emulator).
    const HAS_FP8_MMA: bool;
    /// Whether `mma_mxf8_e4m3_m16n8k32` exists (the block-scaled MXFP8 mma of `sm_120a`;
    /// in the emulator, only on its `sm_120a` target).
    const HAS_MXF8_MMA: bool;

    /// `threadIdx.x`.
    fn thread_idx() -> u32;
    /// `blockIdx.x`.
    fn block_idx() -> u32;
    /// `blockDim.x`.
    fn block_dim() -> u32;
    /// `gridDim.x`.
    fn grid_dim() -> u32;

    /// `__syncthreads()`: every thread of the block must reach it.
    fn sync_threads();

    /// Reads a `T` at `byte_offset` of the block's dynamic shared memory.
    ///
    /// # Safety
    /// `byte_offset + size_of::<T>()` must be within the launch's dynamic shared memory,
    /// aligned for `T`, and the bytes must have been written as a valid `T`.
    unsafe fn smem_load<T: Copy>(byte_offset: usize) -> T;

    /// Writes a `T` at `byte_offset` of the block's dynamic shared memory.
    ///
    /// # Safety
    /// As [`Simt::smem_load`]; no other thread may access the same bytes between the
    /// same two barriers.
    unsafe fn smem_store<T: Copy>(byte_offset: usize, value: T);

    /// Atomically adds `value` to the u32 at `byte_offset` of dynamic shared memory and
    /// returns the old value.
    ///
    /// # Safety
    /// As [`Simt::smem_load`] for a `u32`; between two barriers the bytes may be accessed
    /// by atomics only.
    unsafe fn smem_atomic_add_u32(byte_offset: usize, value: u32) -> u32;

    /// `shfl.sync.bfly.b32`: the value of lane `lane_id ^ lane_mask`.
    fn shfl_xor(mask: u32, value: u32, lane_mask: u32) -> u32;
    /// `shfl.sync.idx.b32`: the value of lane `src_lane % 32`.
    fn shfl_idx(mask: u32, value: u32, src_lane: u32) -> u32;
    /// `shfl.sync.down.b32`: the value of lane `lane_id + delta` (own value past lane 31).
    fn shfl_down(mask: u32, value: u32, delta: u32) -> u32;
    /// `vote.sync.ballot.b32`: bit `i` set when lane `i` passed `true`.
    fn ballot(mask: u32, predicate: bool) -> u32;

    /// Loads one `T` from global memory: a single `ld.global` of `size_of::<T>()` bytes
    /// (`.u8`, `.u16`, `.u32`, `.u64` or `.v4.u32`).
    ///
    /// # Safety
    /// `ptr` is a `size_of::<T>()`-aligned address inside a buffer of the launch, whose
    /// bytes hold a `T` and are not written by another thread of the launch (without an
    /// ordering atomic in between).
    unsafe fn gld<T: Word>(ptr: GlobalPtr<T>) -> T;

    /// Stores one `T` to global memory: a single `st.global` of `size_of::<T>()` bytes.
    ///
    /// # Safety
    /// `ptr` is a `size_of::<T>()`-aligned address inside a buffer the launch writes, and
    /// no other thread of the launch accesses the same bytes (without an ordering atomic
    /// in between).
    unsafe fn gst<T: Word>(ptr: GlobalMut<T>, value: T);

    /// `atom.global.add.u32`; returns the old value.
    ///
    /// # Safety
    /// `ptr` is a 4-byte aligned address inside a buffer the launch writes; between
    /// launches' orderings, the word is only accessed atomically.
    unsafe fn atomic_add_u32(ptr: GlobalMut<u32>, value: u32) -> u32;

    /// `membar.gl` (`__threadfence()`): this thread's global writes before it are seen by
    /// every thread of the GPU before its global writes after it.
    fn threadfence();

    /// `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32` on this lane's fragments
    /// (PTX ISA fragment layout: `g = lane / 4`, `t = lane % 4`; A regs = rows {g, g+8} ×
    /// k {2t, 2t+1} and {2t+8, 2t+9}; B regs = k {2t, 2t+1}, {2t+8, 2t+9} × column g;
    /// C/D = rows {g, g+8} × columns {2t, 2t+1}; low half-word = lower index).
    fn mma_bf16_m16n8k16(a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4];

    /// `mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32` (A regs = rows {g, g+8} ×
    /// k 4t..4t+3 and 16+4t..; B regs = k 4t..4t+3, 16+4t.. × column g; C/D as bf16).
    /// Only valid when [`Simt::HAS_FP8_MMA`].
    fn mma_e4m3_m16n8k32(a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4];

    /// `mma.sync.aligned.m16n8k32.row.col.kind::mxf8f6f4.block_scale.scale_vec::1X.f32.
    /// e4m3.e4m3.f32.ue8m0`: `D = C + (2^(sa_r − 127) · A) · (2^(sb_c − 127) · B)` with the
    /// e4m3 fragments of [`Simt::mma_e4m3_m16n8k32`] and one ue8m0 scale per A row and per
    /// B column (`0xff`: NaN), byte 0 of the scale registers (selectors 0): lane `4g`
    /// gives A row `g` (`sfa`) and B column `g` (`sfb`), lane `4g + 1` A row `g + 8`; the
    /// other lanes' scale registers are ignored. Only valid when [`Simt::HAS_MXF8_MMA`].
    fn mma_mxf8_e4m3_m16n8k32(
        a: [u32; 4],
        b: [u32; 2],
        c: [f32; 4],
        sfa: u32,
        sfb: u32,
    ) -> [f32; 4];

    /// Lane within the warp.
    #[inline(always)]
    fn lane_id() -> u32 {
        Self::thread_idx() & 31
    }
    /// Warp within the block.
    #[inline(always)]
    fn warp_id() -> u32 {
        Self::thread_idx() >> 5
    }
    /// `blockIdx.x * blockDim.x + threadIdx.x`.
    #[inline(always)]
    fn global_idx() -> u32 {
        Self::block_idx() * Self::block_dim() + Self::thread_idx()
    }
    /// `shfl_xor` of an f32.
    #[inline(always)]
    fn shfl_xor_f32(mask: u32, value: f32, lane_mask: u32) -> f32 {
        f32::from_bits(Self::shfl_xor(mask, value.to_bits(), lane_mask))
    }
    /// `__any_sync`.
    #[inline(always)]
    fn any(mask: u32, predicate: bool) -> bool {
        Self::ballot(mask, predicate) != 0
    }
}

/// Mask of the lanes of warp `warp` that exist in a block of `block_dim` threads (the last
/// warp of a block whose size is not a multiple of 32 is partial).
#[inline(always)]
pub const fn warp_mask(block_dim: u32, warp: u32) -> u32 {
    let first = warp * 32;
    if block_dim >= first + 32 {
        u32::MAX
    } else if block_dim <= first {
        0
    } else {
        (1u32 << (block_dim - first)) - 1
    }
}
