//! Loading the kernels onto a device: first the arch-specific images of the device's exact
//! compute capability (`sm_120a` on 12.0: SASS, then PTX; they carry the block-scaled
//! MXFP8 paths) unless [`GENERIC_ENV`] is `1`, then the SASS ptxas built for the device's
//! arch when this binary carries it, else the PTX of the newest arch not newer than the
//! device (JIT-compiled by the driver), else the sm_80 PTX (the lowest PTX version, for
//! drivers older than the newer archs' PTX). A candidate that fails to load is reported
//! with the driver's error and, for PTX, the JIT compiler's log; the first one that loads
//! is used.

use std::ffi::{c_void, CString};
use std::sync::Arc;

use cudarc::driver::sys::{self, CUjit_option, CUresult};
use cudarc::driver::{CudaContext, CudaModule};
use cudarc::nvrtc::Ptx;
use sparsekit_host::{Error, Result};

use crate::ptx::{cubin_for_device, ptx_for_device, CUBINS, PTX};

/// Set to `1` to skip the arch-specific images (`sm_120a`) and run the kernels every arch
/// of the family runs (the bf16 tensor-core paths): for side-by-side benchmarks, or as a
/// way around a driver that mishandles them.
pub const GENERIC_ENV: &str = "SPARSEKIT_CUDA_GENERIC";

/// One way to load the kernels.
#[derive(Clone, Copy, Debug)]
pub(super) enum Image {
    /// ptxas's SASS for `arch` (no JIT).
    Cubin {
        arch: &'static str,
        bytes: &'static [u8],
    },
    /// The PTX for `arch`, compiled by the driver's JIT.
    Ptx {
        arch: &'static str,
        text: &'static str,
    },
}

impl Image {
    /// `cubin sm_90`, `PTX sm_80`.
    pub(super) fn label(&self) -> String {
        match self {
            Image::Cubin { arch, .. } => format!("cubin {arch}"),
            Image::Ptx { arch, .. } => format!("PTX {arch}"),
        }
    }
}

/// The images to try for a device of compute capability `major.minor`, in order.
pub(super) fn candidates(major: u32, minor: u32) -> Vec<Image> {
    let generic = std::env::var(GENERIC_ENV).is_ok_and(|v| v == "1");
    candidates_for(major, minor, !generic)
}

/// [`candidates`], with or without the arch-specific images.
fn candidates_for(major: u32, minor: u32, arch_specific: bool) -> Vec<Image> {
    let mut out = Vec::new();
    if major < 8 {
        // Below sm_80 nothing runs (the kernels need sm_80's mma and cp.async).
        return out;
    }
    if arch_specific {
        // `sm_XYa` runs on compute capability X.Y only (no forward compatibility).
        let name = format!("sm_{major}{minor}a");
        if let Some(&(arch, bytes)) = CUBINS.iter().find(|(a, _)| *a == name) {
            out.push(Image::Cubin { arch, bytes });
        }
        if let Some(&(arch, text)) = PTX.iter().find(|(a, _)| *a == name) {
            out.push(Image::Ptx { arch, text });
        }
    }
    if let Some((arch, bytes)) = cubin_for_device(major, minor) {
        out.push(Image::Cubin { arch, bytes });
    }
    if let Some((arch, text)) = ptx_for_device(major, minor) {
        out.push(Image::Ptx { arch, text });
    }
    if let Some(&(arch, text)) = PTX.iter().find(|(a, _)| *a == "sm_80") {
        if !out
            .iter()
            .any(|i| matches!(i, Image::Ptx { arch: a, .. } if *a == arch))
        {
            out.push(Image::Ptx { arch, text });
        }
    }
    out
}

/// Loads the first candidate that the driver accepts; returns the module and what was
/// loaded (with the failures before it, if any). Fails with every candidate's error and
/// JIT log when none loads.
pub(super) fn load(
    ctx: &Arc<CudaContext>,
    major: u32,
    minor: u32,
) -> Result<(Arc<CudaModule>, String)> {
    let mut failures: Vec<String> = Vec::new();
    for image in candidates(major, minor) {
        let loaded = match image {
            Image::Cubin { bytes, .. } => ctx.load_module(Ptx::from_binary(bytes.to_vec())),
            Image::Ptx { text, .. } => ctx.load_module(Ptx::from_src(text)),
        };
        match loaded {
            Ok(m) => {
                let mut what = image.label();
                if !failures.is_empty() {
                    what = format!("{what}, after: {}", failures.join("; "));
                }
                return Ok((m, what));
            }
            Err(e) => {
                let log = match image {
                    Image::Ptx { text, .. } => jit_log(ctx, text),
                    Image::Cubin { .. } => String::new(),
                };
                let log = if log.is_empty() {
                    String::new()
                } else {
                    format!(" (JIT log: {})", log.trim())
                };
                failures.push(format!("{} failed to load: {e}{log}", image.label()));
            }
        }
    }
    Err(Error::Device(format!(
        "no kernel image loads on this device (compute capability {major}.{minor}): {}",
        if failures.is_empty() {
            "this binary carries none for it".to_string()
        } else {
            failures.join("; ")
        }
    )))
}

/// The JIT compiler's error log for `ptx` on the current device (empty when it compiles
/// or the log cannot be read): loads it once more with a log buffer and unloads it.
fn jit_log(ctx: &Arc<CudaContext>, ptx: &str) -> String {
    let Ok(src) = CString::new(ptx) else {
        return "the PTX contains a NUL byte".into();
    };
    if ctx.bind_to_thread().is_err() {
        return String::new();
    }
    const LOG_BYTES: usize = 16 * 1024;
    let mut log = vec![0u8; LOG_BYTES];
    let mut options = [
        CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
        CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
    ];
    let mut values: [*mut c_void; 2] = [log.as_mut_ptr().cast(), LOG_BYTES as *mut c_void];
    let mut module: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: `src` is a NUL-terminated PTX image alive for the call; the two options
    // give the driver a buffer of `LOG_BYTES` bytes (the size is passed by value in the
    // pointer-sized slot, as the driver API specifies) that outlives the call; `module`
    // receives a handle only on success, and is unloaded right away. The context is
    // current on this thread (bound above).
    let r = unsafe {
        sys::cuModuleLoadDataEx(
            &mut module,
            src.as_ptr().cast(),
            options.len() as u32,
            options.as_mut_ptr(),
            values.as_mut_ptr(),
        )
    };
    if r == CUresult::CUDA_SUCCESS && !module.is_null() {
        // SAFETY: a module this function loaded and nobody else has seen.
        unsafe { sys::cuModuleUnload(module) };
    }
    let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
    String::from_utf8_lossy(&log[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The load order per device (no GPU needed): the exact arch's cubin, then the PTX of
    /// the newest arch not newer than the device, then the sm_80 PTX.
    #[test]
    fn candidates_in_order() {
        if PTX.is_empty() || crate::ptx::CUBINS.is_empty() {
            eprintln!("no PTX or cubins embedded: nothing to order");
            return;
        }
        let labels = |ma, mi| -> Vec<String> {
            candidates_for(ma, mi, true)
                .iter()
                .map(Image::label)
                .collect()
        };
        assert_eq!(labels(9, 0), ["cubin sm_90", "PTX sm_90", "PTX sm_80"]);
        assert_eq!(
            labels(12, 0),
            [
                "cubin sm_120a",
                "PTX sm_120a",
                "cubin sm_120",
                "PTX sm_120",
                "PTX sm_80"
            ]
        );
        assert_eq!(
            labels(12, 1),
            ["cubin sm_120", "PTX sm_120", "PTX sm_80"],
            "sm_120a images run on 12.0 only"
        );
        let generic: Vec<String> = candidates_for(12, 0, false)
            .iter()
            .map(Image::label)
            .collect();
        assert_eq!(generic, ["cubin sm_120", "PTX sm_120", "PTX sm_80"]);
        assert_eq!(labels(8, 9), ["cubin sm_80", "PTX sm_80"]);
        assert_eq!(
            labels(10, 0),
            ["PTX sm_90", "PTX sm_80"],
            "no SASS for 10.x"
        );
        assert!(labels(7, 5).is_empty());
    }
}
