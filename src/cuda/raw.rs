//! Launches on a **borrowed** CUDA stream: the kernels of the embedded PTX run on a stream
//! another library owns (PyTorch's current stream, for the Python package), with buffers
//! that library allocated.
//!
//! cudarc's safe layer cannot wrap a stream it did not create (a `CudaStream` owns and
//! destroys its handle), so this module launches through cudarc's `sys` layer
//! (`cuLaunchKernel` on the raw `CUstream`). It uses the device's **primary context**
//! (`CudaContext::new` retains it), the one the CUDA runtime — and so PyTorch — uses, so
//! device addresses from the other library are valid here. The kernels are loaded once per
//! device (`module::load`: cubin for the exact arch, else PTX) and their
//! functions cached. A launch only enqueues: no allocation, no copy, no synchronisation,
//! so it is safe inside CUDA graph capture on that stream — once the kernels are loaded:
//! the first call on a device loads the module (a synchronous driver call), so make one
//! before capturing, as frameworks do with their warm-up runs.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::{self, CUfunction_attribute_enum, CUresult};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use sparsekit_host::{Error, Result};
use sparsekit_kernels::launch::{KernelParams, DEFAULT_DYN_SMEM};

use super::{cuda, driver_present, module};
use crate::ptx::{PTX, PTX_BUILD_INFO};

/// The kernels loaded on one device's primary context.
pub struct RawLauncher {
    ctx: Arc<CudaContext>,
    module: Arc<CudaModule>,
    /// What was loaded (`cubin sm_90`, `PTX sm_80, after: ...`).
    image: String,
    /// Each kernel's function and the dynamic shared memory it was opted in to so far.
    functions: Mutex<HashMap<&'static str, (CudaFunction, u32)>>,
}

impl std::fmt::Debug for RawLauncher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RawLauncher({})", self.image)
    }
}

/// One launcher per device ordinal, made on first use.
fn launchers() -> &'static Mutex<HashMap<usize, Arc<RawLauncher>>> {
    static L: OnceLock<Mutex<HashMap<usize, Arc<RawLauncher>>>> = OnceLock::new();
    L.get_or_init(|| Mutex::new(HashMap::new()))
}

impl RawLauncher {
    /// The launcher of device `ordinal` (its primary context), loading the kernels on
    /// first use. Fails with a clear message when there is no driver, no device or no PTX
    /// in this build.
    pub fn for_device(ordinal: usize) -> Result<Arc<RawLauncher>> {
        let mut all = launchers()
            .lock()
            .map_err(|_| Error::Device("launcher table lock poisoned".into()))?;
        if let Some(l) = all.get(&ordinal) {
            return Ok(l.clone());
        }
        if !driver_present() {
            return Err(Error::Device(
                "no CUDA driver (libcuda.so) on this machine".into(),
            ));
        }
        if PTX.is_empty() {
            return Err(Error::Device(format!(
                "this build carries no PTX ({PTX_BUILD_INFO}); run scripts/setup-gpu-tools.sh and rebuild"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(cuda("context creation"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(cuda("compute capability"))?;
        let (module, image) = module::load(&ctx, major as u32, minor as u32)?;
        let l = Arc::new(RawLauncher {
            ctx,
            module,
            image,
            functions: Mutex::new(HashMap::new()),
        });
        all.insert(ordinal, l.clone());
        Ok(l)
    }

    /// What the kernels were loaded from.
    pub fn image(&self) -> &str {
        &self.image
    }

    /// The kernel `name`, opted in to `smem` bytes of dynamic shared memory (the
    /// attribute is set once per kernel and size, not at every launch).
    fn function(&self, name: &'static str, smem: u32) -> Result<CudaFunction> {
        let mut cache = self
            .functions
            .lock()
            .map_err(|_| Error::Device("cuda function cache lock poisoned".into()))?;
        let (f, opted) = match cache.get(name) {
            Some(entry) => entry.clone(),
            None => {
                let f = self
                    .module
                    .load_function(name)
                    .map_err(cuda("function load"))?;
                (f, DEFAULT_DYN_SMEM)
            }
        };
        let mut opted = opted;
        if smem > opted {
            // Above the default a kernel must opt in to its dynamic shared memory.
            f.set_attribute(
                CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(cuda("shared memory attribute"))?;
            opted = smem;
        }
        cache.insert(name, (f.clone(), opted));
        Ok(f)
    }

    /// Enqueues the kernel of `params` with its own geometry on `stream` (a raw
    /// `CUstream` handle of this device's primary context; 0 is the legacy default
    /// stream). Returns once the launch is enqueued.
    ///
    /// # Safety
    /// `stream` is a live stream of this device's primary context, and `params` holds
    /// addresses of device memory that stays allocated until the kernel completes,
    /// filled from descriptors validated against those buffers, with metadata contents
    /// the kernel's contract accepts (see `sparsekit_host::launcher::raw`).
    pub unsafe fn launch<P: KernelParams>(&self, stream: usize, params: P) -> Result<()> {
        let l = params.launch();
        let f = self.function(P::ENTRY, l.smem_bytes)?;
        self.ctx.bind_to_thread().map_err(cuda("context bind"))?;
        let mut p = params;
        let mut args: [*mut c_void; 1] = [(&mut p as *mut P).cast()];
        // SAFETY: `f` is a function of the module loaded on this context, which is
        // current on this thread (bound above); its one parameter is the `#[repr(C)]`
        // struct `P` (`KernelParams` is sealed to the kernels' parameter structs, the
        // same definitions the PTX entry point `P::ENTRY` was built from), passed by
        // address in a one-element argument array that outlives the call (the driver
        // copies the argument at launch); the geometry is the kernel's own, with its
        // shared memory allowance raised above; `stream` and the addresses inside `p`
        // are the caller's contract.
        let r = unsafe {
            sys::cuLaunchKernel(
                f.cu_function(),
                l.grid,
                1,
                1,
                l.block,
                1,
                1,
                l.smem_bytes,
                stream as sys::CUstream,
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        if r != CUresult::CUDA_SUCCESS {
            return Err(Error::Device(format!(
                "launch of {} failed: {r:?}",
                P::ENTRY
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a driver (CI, laptops) the launcher says so instead of touching cudarc.
    #[test]
    fn no_driver_is_a_clear_error() {
        if driver_present() {
            return;
        }
        let e = RawLauncher::for_device(0).unwrap_err().to_string();
        assert!(e.contains("no CUDA driver"), "{e}");
    }
}
