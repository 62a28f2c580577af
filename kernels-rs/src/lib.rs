//! sparsekit GPU kernels: `#![no_std]` Rust generic over the [`Simt`] trait.
//!
//! - The root package's build script compiles this crate for `nvptx64-nvidia-cuda` (nightly,
//!   `-Zbuild-std=core`) into PTX for sm_80, sm_90 and sm_120; `device` holds the nvptx
//!   implementation of [`Simt`] and the `extern "ptx-kernel"` entry points.
//! - With the `emu` feature the same kernels run on the host in the SIMT emulator
//!   ([`emu`]), which is how their index arithmetic is validated without a GPU.
//!
//! Kernel parameter structs ([`params`]) are `#[repr(C)]`, defined once here and used by
//! device code and every launcher; each names its kernel through [`KernelParams`]
//! ([`launch`]), so a launcher cannot pass one kernel's parameters to another.
#![cfg_attr(not(any(feature = "emu", test)), no_std)]
#![cfg_attr(
    target_arch = "nvptx64",
    feature(
        abi_ptx,
        stdarch_nvptx,
        asm_experimental_arch,
        gpu_intrinsics,
        gpu_launch_sized_workgroup_mem,
        core_intrinsics,
        link_llvm_intrinsics,
        abi_unadjusted
    )
)]
#![cfg_attr(target_arch = "nvptx64", allow(internal_features))]

pub mod checksum;
pub mod fp8;
pub mod global;
pub mod kernels;
pub mod launch;
pub mod math;
pub mod mx;
pub mod params;
pub mod simt;

#[cfg(target_arch = "nvptx64")]
pub mod device;

#[cfg(feature = "emu")]
pub mod emu;

pub use global::{GlobalMut, GlobalPtr, V2, V4};
pub use launch::{KernelParams, ENTRY_POINTS};
pub use simt::Simt;

#[cfg(target_arch = "nvptx64")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
    // SAFETY: `trap` aborts the kernel; the host sees a launch failure on its next
    // synchronising call.
    unsafe { core::arch::nvptx::trap() }
}
