//! Per-thread working buffers that outlive a call: an op's tasks borrow their thread's set
//! instead of allocating (and zero-filling, and page-faulting) one per rayon job split —
//! `for_each_init` makes a new set for every split, which at decode sizes (a few dozen
//! tasks) costs as much as the arithmetic. A set grows to the largest call its thread has
//! run and is kept for the thread's life; its contents carry nothing from one task to the
//! next (every task sizes and resets what it reads).
//!
//! The buffers the GEMM tiles read (the attention's, the indexer's, the GEMM's packed
//! blocks) are [`Aligned`]: their first element starts a cache line, as the host buffers'
//! does, so that a vector load of a row never straddles two lines.

use std::cell::RefCell;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::thread::LocalKey;

use bytemuck::{Pod, Zeroable};

use super::buffer::Line;

/// A growable buffer of `T` (a plain value of at most 64 bytes, a divisor of 64) whose
/// first element is 64-byte aligned: a `Vec` from the allocator starts only 16-byte
/// aligned (a large one 16 bytes past a page), and then every other 32-byte load and every
/// 64-byte load of a row crosses two cache lines (AVX-512 GEMM tiles measured 20% slower
/// on such a buffer). Dereferences to `[T]` of its length.
pub(crate) struct Aligned<T> {
    lines: Vec<Line>,
    len: usize,
    _t: PhantomData<T>,
}

impl<T> Aligned<T> {
    /// An empty buffer (no allocation).
    pub(crate) const fn new() -> Self {
        Aligned {
            lines: Vec::new(),
            len: 0,
            _t: PhantomData,
        }
    }
}

impl<T> Default for Aligned<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Pod> Aligned<T> {
    /// Whole elements fill a line (checked when the type is used, at compile time).
    const FITS: () = assert!(
        std::mem::size_of::<T>() > 0 && 64 % std::mem::size_of::<T>() == 0,
        "an Aligned element's size must divide 64"
    );

    /// Sets the length to `len` elements: the first `min(len, old len)` keep their values,
    /// new ones are `value` (as [`Vec::resize`]).
    pub(crate) fn resize(&mut self, len: usize, value: T) {
        let () = Self::FITS;
        let old = self.len;
        let lines = (len * std::mem::size_of::<T>()).div_ceil(64);
        if lines > self.lines.len() {
            self.lines.resize(lines, Line::zeroed());
        }
        self.len = len;
        if len > old {
            self[old..].fill(value);
        }
    }
}

impl<T: Pod> Deref for Aligned<T> {
    type Target = [T];
    #[inline(always)]
    fn deref(&self) -> &[T] {
        &bytemuck::cast_slice(&self.lines)[..self.len]
    }
}

impl<T: Pod> DerefMut for Aligned<T> {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut [T] {
        &mut bytemuck::cast_slice_mut(&mut self.lines)[..self.len]
    }
}

/// Runs `f` with this thread's set in `key`, or with a fresh default set when the thread's
/// one is already borrowed (an op called from inside another op's task on the same thread).
pub(crate) fn with<S: Default + 'static, R>(
    key: &'static LocalKey<RefCell<S>>,
    f: impl FnOnce(&mut S) -> R,
) -> R {
    key.with(|cell| match cell.try_borrow_mut() {
        Ok(mut set) => f(&mut set),
        Err(_) => f(&mut S::default()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        static SET: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    }

    #[test]
    fn the_set_is_reused_and_nesting_gets_a_fresh_one() {
        with(&SET, |v| v.extend([1, 2, 3]));
        let (outer, inner) = with(&SET, |v| {
            let inner = with(&SET, |w| {
                w.push(9);
                w.clone()
            });
            (v.clone(), inner)
        });
        assert_eq!(outer, [1, 2, 3]);
        assert_eq!(inner, [9]);
        assert_eq!(with(&SET, |v| v.len()), 3);
    }

    /// `Aligned` starts on a cache line at every size and resizes as `Vec` does.
    #[test]
    fn aligned_resizes_like_a_vec_and_stays_aligned() {
        let mut a = Aligned::<u16>::default();
        let mut v = Vec::<u16>::new();
        for (i, len) in [0usize, 1, 31, 32, 33, 7, 100_000, 5, 70_000]
            .into_iter()
            .enumerate()
        {
            a.resize(len, i as u16 + 1);
            v.resize(len, i as u16 + 1);
            assert_eq!(&a[..], &v[..], "len {len}");
            assert_eq!(a.as_ptr() as usize % 64, 0);
            // A write through the slice lands in the buffer.
            if let Some(x) = a.last_mut() {
                *x = 0xbeef;
                *v.last_mut().unwrap() = 0xbeef;
            }
        }
        let mut f = Aligned::<f32>::default();
        f.resize(3, 1.5);
        assert_eq!(&f[..], [1.5; 3]);
    }
}
