//! The performance model's accounting, pinned on small kernels whose counts are known by
//! hand: a perfectly coalesced copy, a strided copy, shared-memory accesses with 32-way
//! and no bank conflicts, a divergent store, barriers and mma counts, block sampling.
#![cfg(feature = "emu")]
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use sparsekit_kernels::emu::{
    profile_launch, BufferAccess, Emu, GlobalBuffers, GlobalOp, LaunchConfig, Params, Profile,
    Space,
};
use sparsekit_kernels::global::{GlobalMut, GlobalPtr};
use sparsekit_kernels::simt::Simt;

#[derive(Clone, Copy)]
struct Args {
    src: GlobalPtr<u32>,
    dst: GlobalMut<u32>,
    /// Element stride of the loads.
    stride: usize,
}

/// `dst[i] = src[stride · i]`, one u32 per thread.
///
/// # Safety
/// `src` holds `stride · n` and `dst` `n` u32, n = grid · block.
unsafe fn strided_copy<S: Simt>(a: Args) {
    let i = S::global_idx() as usize;
    // SAFETY: in bounds (contract).
    unsafe { S::gst(a.dst.add(i), S::gld(a.src.add(a.stride * i))) };
}

/// Each lane stores and loads one shared u32 at `stride_words · lane`, around a barrier;
/// lanes below 8 then store their value to global memory (divergent).
///
/// # Safety
/// `32 · stride_words · 4` bytes of shared memory; `dst` holds one u32 per thread.
unsafe fn smem_pattern<S: Simt>(a: Args) {
    let lane = S::lane_id() as usize;
    let at = 4 * a.stride * lane + 4 * 32 * a.stride * S::warp_id() as usize;
    // SAFETY: inside the launch's shared memory; one owner per word.
    unsafe { S::smem_store::<u32>(at, lane as u32) };
    S::sync_threads();
    // SAFETY: stored before the barrier by this thread.
    let v = unsafe { S::smem_load::<u32>(at) };
    if lane < 8 {
        // SAFETY: one element per thread.
        unsafe { S::gst(a.dst.add(S::global_idx() as usize), v) };
    }
}

/// One bf16 mma per warp.
///
/// # Safety
/// None beyond a full-warp block.
unsafe fn one_mma<S: Simt>(_: Args) {
    let d = S::mma_bf16_m16n8k16([0x3f80_3f80; 4], [0x3f80_3f80; 2], [0.0; 4]);
    assert_eq!(d, [16.0; 4]);
}

/// 64-byte aligned u32 storage (sectors are counted at absolute 32-byte boundaries, as on
/// the GPU, whose allocations are 256-byte aligned).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u32; 16]);

fn aligned(values: impl ExactSizeIterator<Item = u32>) -> Vec<Line> {
    let n = values.len();
    let mut v = vec![Line([0; 16]); n.div_ceil(16).max(1)];
    for (i, x) in values.enumerate() {
        v[i / 16].0[i % 16] = x;
    }
    v
}

fn words(v: &[Line], n: usize) -> Vec<u32> {
    v.iter().flat_map(|l| l.0).take(n).collect()
}

fn profile(
    kernel: unsafe fn(Args),
    grid: u32,
    block: u32,
    smem: usize,
    stride: usize,
    sample: Option<&[u32]>,
) -> (Profile, Vec<u32>) {
    let n = (grid * block) as usize;
    let src_n = (stride * n).max(1);
    let src = aligned(0..src_n as u32);
    let mut dst = aligned(std::iter::repeat_n(0, n));
    let mut bufs = GlobalBuffers::new("pinned");
    bufs.add("src", src.as_ptr() as usize, 4 * src_n, BufferAccess::Read)
        .unwrap();
    bufs.add("dst", dst.as_ptr() as usize, 4 * n, BufferAccess::Write)
        .unwrap();
    let args = Args {
        src: GlobalPtr::from_raw(src.as_ptr().cast::<u32>()),
        dst: GlobalMut::from_raw(dst.as_mut_ptr().cast::<u32>()),
        stride,
    };
    // SAFETY: the buffers outlive the launch; the kernels stay inside them.
    let p = unsafe { Params::new(args) };
    let cfg = LaunchConfig {
        grid,
        block,
        dyn_smem_bytes: smem,
    };
    // SAFETY: as above.
    let prof = profile_launch(cfg, &bufs, sample, || unsafe { kernel(p.get()) }).unwrap();
    (prof, words(&dst, n))
}

#[test]
fn coalesced_copy_moves_whole_sectors() {
    let (p, dst) = profile(strided_copy::<Emu>, 2, 64, 0, 1, None);
    assert_eq!(dst, (0..128).collect::<Vec<u32>>());
    assert_eq!(
        (p.kernel.as_str(), p.grid, p.block, p.blocks_run),
        ("pinned", 2, 64, 2)
    );
    for op in [GlobalOp::Load, GlobalOp::Store] {
        let t = p.total(Space::Global, Some(op));
        // 2 blocks × 2 warps, each 32 lanes × 4 bytes = 128 bytes = 4 sectors.
        assert_eq!(t.instructions, 4, "{op}");
        assert_eq!((t.bytes, t.sectors, t.useful_bytes), (512, 16, 512), "{op}");
        assert_eq!(t.efficiency(), Some(1.0));
        assert_eq!(t.widths, [0, 0, 4, 0, 0], "all 4-byte accesses");
        assert_eq!(t.active_lanes(), Some(1.0));
    }
    assert_eq!((p.unique_load_bytes, p.unique_store_bytes), (512, 512));
    assert_eq!(p.barriers, 0);
    assert_eq!(p.sites.len(), 2, "one load site, one store site");
}

#[test]
fn strided_copy_wastes_seven_eighths_of_each_sector() {
    // Stride 8 u32 = 32 bytes: every lane in its own sector.
    let (p, dst) = profile(strided_copy::<Emu>, 1, 32, 0, 8, None);
    assert_eq!(dst, (0..32).map(|i| 8 * i).collect::<Vec<u32>>());
    let ld = p.total(Space::Global, Some(GlobalOp::Load));
    assert_eq!((ld.instructions, ld.bytes, ld.sectors), (1, 128, 32));
    assert_eq!(ld.efficiency(), Some(0.125));
    let st = p.total(Space::Global, Some(GlobalOp::Store));
    assert_eq!(st.efficiency(), Some(1.0));
    assert_eq!(p.unique_load_bytes, 32 * 32);
}

#[test]
fn thirty_two_way_bank_conflict_and_none() {
    // Stride 32 words: every lane of a warp in bank 0.
    let (p, _) = profile(smem_pattern::<Emu>, 1, 64, 2 * 32 * 32 * 4, 32, None);
    for op in [GlobalOp::Store, GlobalOp::Load] {
        let t = p.total(Space::Shared, Some(op));
        assert_eq!(t.instructions, 2, "{op}: one per warp");
        assert_eq!(t.ways(), Some(32.0), "{op}");
    }
    assert_eq!(p.barriers, 1);
    assert_eq!(p.barriers_per_block(), 1.0);
    // Consecutive words: conflict-free.
    let (p, _) = profile(smem_pattern::<Emu>, 2, 64, 2 * 32 * 4, 1, None);
    for op in [GlobalOp::Store, GlobalOp::Load] {
        assert_eq!(p.total(Space::Shared, Some(op)).ways(), Some(1.0), "{op}");
    }
    assert_eq!(p.barriers, 2, "one per block");
    // The global stores of lanes 0..8 only: a quarter of the lanes active.
    let st = p.total(Space::Global, Some(GlobalOp::Store));
    assert_eq!(st.instructions, 4);
    assert_eq!(st.active_lanes(), Some(0.25));
    assert_eq!((st.bytes, st.sectors), (4 * 32, 4));
}

#[test]
fn mma_and_collectives_are_counted_per_warp() {
    let (p, _) = profile(one_mma::<Emu>, 3, 96, 0, 0, None);
    assert_eq!((p.mma_bf16, p.mma_e4m3), (9, 0), "3 blocks × 3 warps");
    assert!(p.sites.is_empty());
}

#[test]
fn a_block_sample_runs_only_those_blocks_of_the_full_grid() {
    let (p, dst) = profile(strided_copy::<Emu>, 4, 32, 0, 1, Some(&[2]));
    assert_eq!((p.grid, p.blocks_run), (4, 1));
    assert_eq!(p.total(Space::Global, Some(GlobalOp::Load)).instructions, 1);
    for (i, x) in dst.iter().enumerate() {
        let want = if (64..96).contains(&i) { i as u32 } else { 0 };
        assert_eq!(*x, want, "{i}: only block 2 ran");
    }
}

#[test]
fn profiles_are_deterministic() {
    let a = profile(smem_pattern::<Emu>, 3, 96, 3 * 32 * 4 * 4, 4, None).0;
    let b = profile(smem_pattern::<Emu>, 3, 96, 3 * 32 * 4 * 4, 4, None).0;
    assert_eq!(a, b);
    // Stride 4 words: lanes 0, 8, 16, 24 share a bank: 4-way.
    assert_eq!(
        a.total(Space::Shared, Some(GlobalOp::Load)).ways(),
        Some(4.0)
    );
}
