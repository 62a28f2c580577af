//! The emulator's global-memory checks: deliberately bad kernels, one per class of fault
//! (out-of-bounds read, out-of-bounds write, misaligned vector access, store to an input,
//! uninitialised read), each reported with kernel, block, thread, buffer and offset; and
//! the same kernels with correct arguments passing.
#![cfg(feature = "emu")]
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use sparsekit_kernels::emu::Emu;
use sparsekit_kernels::emu::{
    launch_checked, BufferAccess, EmuError, GlobalAccessError, GlobalBuffers, GlobalFault,
    GlobalOp, LaunchConfig, Params,
};
use sparsekit_kernels::global::{GlobalMut, GlobalPtr, V4};
use sparsekit_kernels::simt::Simt;

#[derive(Clone, Copy)]
struct Args {
    src: GlobalPtr<u32>,
    dst: GlobalMut<u32>,
    /// Elements each thread is shifted by (0: in bounds).
    shift: usize,
    /// Byte offset of the vector accesses (0: aligned).
    byte_shift: usize,
}

/// `dst[i + shift] = src[i + shift]` for one u32 per thread.
///
/// # Safety
/// In bounds when `shift` is 0 and both hold `grid · block` u32.
unsafe fn copy_u32<S: Simt>(a: Args) {
    let i = S::global_idx() as usize;
    // SAFETY: the test's contract (deliberately broken by some tests).
    unsafe { S::gst(a.dst.add(i + a.shift), S::gld(a.src.add(i + a.shift))) };
}

/// 16-byte copy at byte offset `byte_shift` of each thread's 16 bytes.
///
/// # Safety
/// Aligned and in bounds when `byte_shift` is 0 and both hold `grid · block` V4.
unsafe fn copy_v4<S: Simt>(a: Args) {
    let i = S::global_idx() as usize;
    let src = a
        .src
        .cast::<u8>()
        .byte_add(16 * i + a.byte_shift)
        .cast::<V4>();
    let dst = a
        .dst
        .cast::<u8>()
        .byte_add(16 * i + a.byte_shift)
        .cast::<V4>();
    // SAFETY: the test's contract (deliberately broken by some tests).
    unsafe { S::gst(dst, S::gld(src)) };
}

/// Stores into its input.
///
/// # Safety
/// `src` holds one u32 per thread (the store itself is the fault under test).
unsafe fn write_input<S: Simt>(a: Args) {
    let i = S::global_idx() as usize;
    let src = GlobalMut::from_addr(a.src.add(i).addr() as u64);
    // SAFETY: in bounds; the buffer is registered read-only, which the emulator reports.
    unsafe { S::gst(src, 1u32) };
}

/// Reads its output before writing it.
///
/// # Safety
/// `dst` holds one u32 per thread.
unsafe fn read_output_first<S: Simt>(a: Args) {
    let i = S::global_idx() as usize;
    // SAFETY: in bounds (the output has not been written: the fault under test).
    let old = unsafe { S::gld(a.dst.add(i).as_const()) };
    // SAFETY: in bounds.
    unsafe { S::gst(a.dst.add(i), old + 1) };
}

/// Writes its output, then reads it back (legal).
///
/// # Safety
/// `dst` holds one u32 per thread.
unsafe fn write_then_read<S: Simt>(a: Args) {
    let i = S::global_idx() as usize;
    // SAFETY: in bounds, this thread's element.
    unsafe {
        S::gst(a.dst.add(i), 7u32);
        let v = S::gld(a.dst.add(i).as_const());
        S::gst(a.dst.add(i), v + 1);
    }
}

const GRID: u32 = 3;
const BLOCK: u32 = 64;
const N: usize = (GRID * BLOCK) as usize;

fn cfg() -> LaunchConfig {
    LaunchConfig {
        grid: GRID,
        block: BLOCK,
        dyn_smem_bytes: 0,
    }
}

/// Runs `kernel` over `src` (input) and `dst` (output) of `words` u32 each, registered.
fn run(
    kernel: unsafe fn(Args),
    words: usize,
    shift: usize,
    byte_shift: usize,
) -> (Result<(), EmuError>, Vec<u32>, Vec<u32>) {
    // 16-byte aligned storage.
    let mut src_v = vec![V4::default(); words.div_ceil(4)];
    let mut dst_v = vec![V4::default(); words.div_ceil(4)];
    let src: &mut [u32] = &mut bytemuck_u32(&mut src_v)[..words];
    for (i, x) in src.iter_mut().enumerate() {
        *x = 1000 + i as u32;
    }
    let src_ptr = src.as_ptr();
    let dst: &mut [u32] = &mut bytemuck_u32(&mut dst_v)[..words];
    let dst_ptr = dst.as_mut_ptr();
    let mut bufs = GlobalBuffers::new("bad_kernel");
    bufs.add("src", src_ptr as usize, 4 * words, BufferAccess::Read)
        .unwrap();
    bufs.add("dst", dst_ptr as usize, 4 * words, BufferAccess::Write)
        .unwrap();
    let args = Args {
        src: GlobalPtr::from_raw(src_ptr),
        dst: GlobalMut::from_raw(dst_ptr),
        shift,
        byte_shift,
    };
    // SAFETY: the buffers outlive the launch; every access outside them is reported by
    // the emulator before it happens (what this test checks).
    let p = unsafe { Params::new(args) };
    // SAFETY: as above.
    let r = launch_checked(cfg(), &bufs, || unsafe { kernel(p.get()) });
    let (s, d) = (src.to_vec(), dst.to_vec());
    (r, s, d)
}

/// A `[V4]` as u32s (V4 is `#[repr(C, align(16))] [u32; 4]`).
fn bytemuck_u32(v: &mut [V4]) -> &mut [u32] {
    // SAFETY: V4 is 4 u32 with no padding; the slice covers exactly its bytes.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u32>(), 4 * v.len()) }
}

fn global_error(r: Result<(), EmuError>) -> GlobalAccessError {
    match r {
        Err(EmuError::GlobalMemory(e)) => *e,
        other => panic!("expected a global memory error, got {other:?}"),
    }
}

#[test]
fn correct_kernels_pass_the_checks() {
    let (r, s, d) = run(copy_u32::<Emu>, N, 0, 0);
    r.unwrap();
    assert_eq!(s, d);
    let (r, s, d) = run(copy_v4::<Emu>, 4 * N, 0, 0);
    r.unwrap();
    assert_eq!(&s[..4 * N], &d[..4 * N]);
    let (r, _, d) = run(write_then_read::<Emu>, N, 0, 0);
    r.unwrap();
    assert!(d.iter().all(|&x| x == 8));
}

#[test]
fn out_of_bounds_read_is_reported() {
    // One word short: the last thread reads (and would write) past the end.
    let (r, _, d) = run(copy_u32::<Emu>, N - 1, 0, 0);
    let e = global_error(r);
    assert_eq!((e.fault, e.op), (GlobalFault::OutOfBounds, GlobalOp::Load));
    assert_eq!(
        (e.kernel.as_str(), e.block, e.thread),
        ("bad_kernel", GRID - 1, BLOCK - 1)
    );
    assert_eq!(e.buffer, Some(("src".to_string(), 4 * (N - 1))));
    assert_eq!(e.offset, 4 * (N as i128 - 1));
    let msg = EmuError::GlobalMemory(Box::new(e)).to_string();
    assert!(msg.contains("out-of-bounds 4-byte global load"), "{msg}");
    assert!(msg.contains("buffer `src`"), "{msg}");
    // Nothing was written past the buffer (the access stopped the launch first).
    assert_eq!(d.len(), N - 1);
}

#[test]
fn out_of_bounds_write_is_reported() {
    // The source is larger than the destination: the read succeeds, the write does not.
    let words = N - 1;
    let mut src = vec![5u32; N];
    let mut dst = vec![0u32; words + 1];
    let mut bufs = GlobalBuffers::new("bad_kernel");
    bufs.add_slice("src", &src[..], BufferAccess::Read).unwrap();
    bufs.add_slice("dst", &dst[..words], BufferAccess::Write)
        .unwrap();
    let args = Args {
        src: GlobalPtr::from_raw(src.as_mut_ptr()),
        dst: GlobalMut::from_raw(dst.as_mut_ptr()),
        shift: 0,
        byte_shift: 0,
    };
    // SAFETY: both vectors outlive the launch and hold N words (only N - 1 of `dst` are
    // registered: the last thread's store is the fault under test).
    let p = unsafe { Params::new(args) };
    // SAFETY: as above.
    let e = global_error(launch_checked(cfg(), &bufs, || unsafe {
        copy_u32::<Emu>(p.get())
    }));
    assert_eq!((e.fault, e.op), (GlobalFault::OutOfBounds, GlobalOp::Store));
    assert_eq!(e.buffer, Some(("dst".to_string(), 4 * words)));
    assert_eq!(e.offset, 4 * words as i128);
    let msg = EmuError::GlobalMemory(Box::new(e)).to_string();
    assert!(msg.contains("0 byte(s) past its end"), "{msg}");
    assert_eq!(dst[words], 0, "the faulting store did not happen");
}

#[test]
fn a_far_wild_access_names_the_nearest_buffer() {
    let (r, _, _) = run(copy_u32::<Emu>, N, 1 << 20, 0);
    let e = global_error(r);
    assert_eq!(e.fault, GlobalFault::OutOfBounds);
    let (name, _) = e.buffer.clone().expect("the nearest buffer is named");
    assert!(name == "src" || name == "dst", "{name}");
    assert!(e.offset >= 4 * N as i128 || e.offset < 0, "{}", e.offset);
}

#[test]
fn misaligned_vector_access_is_reported() {
    // In bounds but 8 bytes off a 16-byte boundary.
    let (r, _, _) = run(copy_v4::<Emu>, 4 * N + 4, 0, 8);
    let e = global_error(r);
    assert_eq!(
        (e.fault, e.op, e.size),
        (GlobalFault::Misaligned, GlobalOp::Load, 16)
    );
    assert_eq!(e.buffer.as_ref().map(|b| b.0.as_str()), Some("src"));
    assert_eq!(e.offset, 8);
    let msg = EmuError::GlobalMemory(Box::new(e)).to_string();
    assert!(msg.contains("misaligned address"), "{msg}");
}

#[test]
fn misaligned_access_is_reported_without_registered_buffers() {
    let mut words = vec![V4::default(); 8];
    let args = Args {
        src: GlobalPtr::from_raw(words.as_ptr().cast::<u32>()),
        dst: GlobalMut::from_raw(words.as_mut_ptr().cast::<u32>()),
        shift: 0,
        byte_shift: 4,
    };
    // SAFETY: the buffer outlives the launch; the misaligned access is reported before it
    // happens.
    let p = unsafe { Params::new(args) };
    let one = LaunchConfig {
        grid: 1,
        block: 1,
        dyn_smem_bytes: 0,
    };
    // SAFETY: as above.
    let r = sparsekit_kernels::emu::launch(one, || unsafe { copy_v4::<Emu>(p.get()) });
    let e = global_error(r);
    assert_eq!((e.fault, e.buffer), (GlobalFault::Misaligned, None));
}

#[test]
fn store_to_an_input_is_reported() {
    let (r, s, _) = run(write_input::<Emu>, N, 0, 0);
    let e = global_error(r);
    assert_eq!((e.fault, e.op), (GlobalFault::ReadOnly, GlobalOp::Store));
    assert_eq!(e.buffer.as_ref().map(|b| b.0.as_str()), Some("src"));
    assert_eq!(s[0], 1000, "the input was not modified");
}

#[test]
fn uninitialised_read_is_reported() {
    let (r, _, _) = run(read_output_first::<Emu>, N, 0, 0);
    let e = global_error(r);
    assert_eq!(
        (e.fault, e.op),
        (GlobalFault::Uninitialised, GlobalOp::Load)
    );
    assert_eq!(e.buffer, Some(("dst".to_string(), 4 * N)));
    assert_eq!(e.offset % 4, 0);
    assert_eq!(
        4 * (e.block * BLOCK + e.thread) as i128,
        e.offset,
        "its own element"
    );
    let msg = EmuError::GlobalMemory(Box::new(e)).to_string();
    assert!(msg.contains("not yet written by this launch"), "{msg}");
}
