//! Reads and writes through raw pointers, and copies, for the kernels' inner loops:
//! compiled to the same instructions with debug assertions (the tests' profile) as
//! without.
//!
//! With debug assertions the standard library checks its `unsafe` preconditions:
//! `ptr::read_unaligned` and `ptr::write_unaligned` (and the `_mm*_loadu_*` and
//! `_mm*_storeu_*` intrinsics built on them) and `copy_from_slice` compare the addresses
//! of source and destination to prove they do not overlap. Comparing an address makes it
//! escape, so LLVM then keeps the temporary (a loaded or stored vector, or a tile's
//! accumulators) in memory: in the f32 GEMM tile every FMA was followed by a store of its
//! accumulator, and the tests ran the model's matmuls 2.5× slower than with the checks off
//! (benches/RESULTS.md, "The tests' build"). A read or write through a pointer to a
//! `packed` wrapper is an unaligned load or store with no such comparison; only the null
//! check of every raw-pointer access remains.

/// A `T` at any address: the same bytes as `T`, aligned to 1.
#[repr(C, packed)]
#[derive(Clone, Copy)]
struct Unaligned<T: Copy>(T);

/// The `T` at `p`, which need not be aligned.
///
/// # Safety
/// `p` points at `size_of::<T>()` readable bytes that hold a valid `T`.
#[inline(always)]
pub(crate) unsafe fn read<T: Copy>(p: *const T) -> T {
    // SAFETY: the caller's contract; `Unaligned<T>` has `T`'s size and alignment 1, and
    // its field is copied out by value, never borrowed.
    unsafe { (*p.cast::<Unaligned<T>>()).0 }
}

/// Writes `v` at `p`, which need not be aligned (the store of [`read`]'s load).
///
/// # Safety
/// `p` points at `size_of::<T>()` writable bytes.
#[inline(always)]
pub(crate) unsafe fn write<T: Copy>(p: *mut T, v: T) {
    // SAFETY: the caller's contract; `Unaligned<T>` has `T`'s size and alignment 1, and
    // it is written whole, by value (`T: Copy`: nothing is dropped).
    unsafe { *p.cast::<Unaligned<T>>() = Unaligned(v) }
}

/// `dst[i] = src[i]` for every `i`: `copy_from_slice` without the overlap check that
/// makes `dst`'s address escape (see the module's doc).
///
/// # Panics
/// If the lengths differ.
#[inline(always)]
pub(crate) fn copy<T: Copy>(dst: &mut [T], src: &[T]) {
    assert_eq!(
        dst.len(),
        src.len(),
        "copy between slices of different lengths"
    );
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn reads_and_writes_at_every_offset_and_copies_exactly() {
        let seed: u64 = rand::random();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let bytes: Vec<u8> = (0..64).map(|_| rng.gen()).collect();
        for off in 0..=48 {
            // SAFETY: bytes `off .. off + 16` of `bytes`, at any alignment.
            let x: [u32; 4] = unsafe { read(bytes.as_ptr().add(off).cast()) };
            let want: Vec<u32> = bytes[off..off + 16]
                .chunks_exact(4)
                .map(|c| u32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            assert_eq!(x.to_vec(), want, "offset {off}, seed {seed}");
        }
        for off in 0..=48 {
            let mut out = vec![0u8; 64];
            let x: [u32; 4] = std::array::from_fn(|_| rng.gen());
            // SAFETY: bytes `off .. off + 16` of `out`, at any alignment.
            unsafe { write(out.as_mut_ptr().add(off).cast(), x) };
            let mut want = vec![0u8; 64];
            for (w, v) in want[off..off + 16].chunks_exact_mut(4).zip(x) {
                w.copy_from_slice(&v.to_ne_bytes());
            }
            assert_eq!(out, want, "write at offset {off}, seed {seed}");
        }
        let src: Vec<u32> = (0..13).map(|_| rng.gen()).collect();
        let mut dst = vec![!src[0]; 13];
        copy(&mut dst, &src);
        assert_eq!(dst, src, "seed {seed}");
    }

    #[test]
    #[should_panic(expected = "different lengths")]
    fn copy_refuses_different_lengths() {
        copy(&mut [0u8; 3], &[1u8; 4]);
    }
}
