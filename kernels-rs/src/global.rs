//! Global memory as kernels see it: typed addresses that can only be read and written
//! through the [`Simt`](crate::Simt) primitives.
//!
//! Kernel parameter structs hold [`GlobalPtr`] (read) and [`GlobalMut`] (read and write)
//! instead of raw pointers. Neither can be dereferenced: the only accesses are
//! [`Simt::gld`](crate::Simt::gld), [`Simt::gst`](crate::Simt::gst) and
//! [`Simt::atomic_add_u32`](crate::Simt::atomic_add_u32), one access of exactly the width
//! of a [`Word`] each. On the GPU they are single `ld.global` / `st.global` instructions of
//! that width (never split into byte accesses, never a generic `ld`); in the emulator every
//! access is checked against the launch's registered buffers (bounds, alignment,
//! uninitialised reads) and can be traced for the performance model. Address arithmetic
//! (`add`, `byte_add`, `cast`) wraps and never touches memory, so computing an address past
//! a buffer is harmless; using it is what the emulator reports.

use core::fmt;
use core::marker::PhantomData;

/// A read-only address in global memory of a `T` (or of an array of them).
#[repr(transparent)]
pub struct GlobalPtr<T> {
    ptr: *const T,
    _t: PhantomData<*const T>,
}

/// A writable address in global memory of a `T` (or of an array of them).
#[repr(transparent)]
pub struct GlobalMut<T> {
    ptr: *mut T,
    _t: PhantomData<*mut T>,
}

macro_rules! address_methods {
    ($ty:ident, $raw:ty, $null:path) => {
        impl<T> Clone for $ty<T> {
            fn clone(&self) -> Self {
                *self
            }
        }
        impl<T> Copy for $ty<T> {}

        impl<T> fmt::Debug for $ty<T> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($ty), "({:#x})"), self.addr())
            }
        }

        impl<T> $ty<T> {
            /// The null address (never dereferenced by a kernel; a marker for "absent").
            pub const fn null() -> Self {
                Self::from_raw($null())
            }
            /// The address `ptr` (a device address on the GPU, a host address in the
            /// emulator).
            pub const fn from_raw(ptr: $raw) -> Self {
                Self {
                    ptr,
                    _t: PhantomData,
                }
            }
            /// The address `addr` (as a launcher gets it from its backend).
            pub fn from_addr(addr: u64) -> Self {
                Self::from_raw(addr as usize as $raw)
            }
            /// The address as an integer.
            pub fn addr(self) -> usize {
                self.ptr as usize
            }
            /// Whether this is the null address.
            pub fn is_null(self) -> bool {
                self.ptr.is_null()
            }
            /// The address `n` elements further (wrapping; nothing is accessed). Named
            /// like the raw pointers' `add`, which kernels are ported from.
            #[allow(clippy::should_implement_trait)]
            #[inline(always)]
            pub fn add(self, n: usize) -> Self {
                Self::from_raw(self.ptr.wrapping_add(n))
            }
            /// The address `n` bytes further (wrapping; nothing is accessed).
            #[inline(always)]
            pub fn byte_add(self, n: usize) -> Self {
                Self::from_raw(self.ptr.wrapping_byte_add(n))
            }
            /// The same address, of a `U`.
            #[inline(always)]
            pub fn cast<U>(self) -> $ty<U> {
                $ty::from_raw(self.ptr.cast::<U>())
            }
            /// The raw pointer (for the `Simt` implementations of this crate).
            #[inline(always)]
            #[cfg_attr(
                not(any(feature = "emu", target_arch = "nvptx64")),
                allow(dead_code, reason = "only the emulator and the device read it")
            )]
            pub(crate) fn raw(self) -> $raw {
                self.ptr
            }
        }
    };
}

address_methods!(GlobalPtr, *const T, core::ptr::null);
address_methods!(GlobalMut, *mut T, core::ptr::null_mut);

impl<T> GlobalMut<T> {
    /// The same address, read-only.
    #[inline(always)]
    pub fn as_const(self) -> GlobalPtr<T> {
        GlobalPtr::from_raw(self.ptr)
    }
}

/// Eight bytes, 8-byte aligned: one `ld/st.global.v2.u32`.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct V2(pub [u32; 2]);

/// Sixteen bytes, 16-byte aligned: one `ld/st.global.v4.u32`.
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct V4(pub [u32; 4]);

mod sealed {
    pub trait Sealed {}
}

/// A value one global-memory instruction moves: 1, 2, 4, 8 or 16 bytes, aligned to its
/// size (an access at an address that is not a multiple of the size faults on the GPU
/// with "misaligned address", and the emulator reports it). Sealed: implemented for the
/// primitive integers and floats up to 8 bytes, [`V2`] and [`V4`].
///
/// # Safety
/// `size_of::<Self>() == align_of::<Self>()` ∈ {1, 2, 4, 8, 16}, and every bit pattern of
/// that size is a valid `Self` (the GPU loads bits).
pub unsafe trait Word: sealed::Sealed + Copy + 'static {}

macro_rules! words {
    ($($t:ty),*) => {
        $(
            impl sealed::Sealed for $t {}
            // SAFETY: a primitive (or a `#[repr(C, align(N))]` array of u32 filling
            // exactly N bytes) whose size equals its alignment; every bit pattern is valid.
            unsafe impl Word for $t {}
            const _: () = assert!(
                core::mem::size_of::<$t>() == core::mem::align_of::<$t>()
            );
        )*
    };
}

words!(u8, i8, u16, i16, u32, i32, f32, u64, i64, f64, V2, V4);
