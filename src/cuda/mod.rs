//! The CUDA backend: the embedded PTX run through cudarc (driver API, loaded dynamically,
//! so building needs no CUDA toolkit and a machine without a driver gets a clear error).
//!
//! One context per device with two non-blocking streams, compute and copy
//! ([`StreamKind`]); a [`CudaBackend`] value is a handle on one of them
//! ([`Backend::on_stream`]). The kernels are loaded on first use (`module.rs`: the cubin
//! ptxas built for the device's exact arch, else its PTX, else the sm_80 PTX, with the
//! JIT log of any failure) and their functions cached.
//!
//! A kernel fault (illegal or misaligned address, trap, ...) leaves the CUDA context
//! unusable: every later driver call would report the same old error. The first call that
//! sees one says so once (on stderr and in its error) and from then on every call of the
//! device fails at once with that one message, touching the driver no more.
//!
//! Its ops are the shared GPU-backend ops of `sparsekit_host::launcher` (the same
//! validation, parameters and geometry as the emulator); this module provides the
//! primitives: buffers ([`CudaBuffer`]), per-call metadata uploads on the handle's stream,
//! buffer addresses with cross-stream ordering, and the typed launch (`P: KernelParams`,
//! whose [`DeviceRepr`] wrapper exists for those types only). Ops are enqueued and return;
//! the host waits only where it needs bytes: downloads, the index check of `sparse_mla`
//! (indices are device data read back before the launch), `synchronize` and host waits on
//! events.

mod buffer;
mod module;
pub mod raw;

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::sys::{CUevent_flags, CUfunction_attribute_enum, CUresult};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr,
    DevicePtrMut, DeviceRepr, DriverError, LaunchConfig, PushKernelArg, SyncOnDrop,
};
use sparsekit_host::backend::DeviceEvent;
use sparsekit_host::launcher::{KernelDevice, Span};
use sparsekit_host::{Backend, Error, Event, Result, StreamKind};
use sparsekit_kernels::launch::{KernelParams, DEFAULT_DYN_SMEM};

use crate::ptx::{PTX, PTX_BUILD_INFO};

pub use buffer::CudaBuffer;
use buffer::{HostBuffer, Memory};

/// A kernel parameter struct passed by value as the kernel's single argument.
#[repr(transparent)]
struct Param<P: KernelParams>(P);

// SAFETY: `P` is one of the kernels' `#[repr(C)]` parameter structs (`KernelParams` is
// sealed to them): plain integers, floats and device addresses, laid out exactly as the
// PTX entry point `P::ENTRY` declares its one parameter (both come from the same struct
// definition in sparsekit-kernels).
unsafe impl<P: KernelParams> DeviceRepr for Param<P> {}

/// Maps a driver error to [`Error::Backend`] (the driver error kept as its source).
fn cuda(context: &'static str) -> impl Fn(DriverError) -> Error + Copy {
    move |e| Error::backend("cuda", context, e)
}

/// Whether the CUDA driver library can be loaded (probed before cudarc touches it, since
/// cudarc panics when it is missing).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen libcuda; no driver call is made.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Waits on the host for `e`, at most [`Event::DEFAULT_TIMEOUT`] (polling, so the wait is
/// bounded whatever the event's flags); driver errors go through `err`.
fn wait_host(e: &CudaEvent, err: impl Fn(DriverError) -> Error) -> Result<()> {
    let start = Instant::now();
    let mut pause = Duration::from_micros(2);
    while !e.try_is_complete().map_err(&err)? {
        if start.elapsed() >= Event::DEFAULT_TIMEOUT {
            return Err(Error::Timeout {
                what: "cuda event",
                after: Event::DEFAULT_TIMEOUT,
            });
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(1));
    }
    Ok(())
}

/// A recorded CUDA event behind a [`sparsekit_host::Event`].
#[derive(Debug)]
struct CudaMarker(CudaEvent);

impl DeviceEvent for CudaMarker {
    fn query(&self) -> Result<bool> {
        self.0.try_is_complete().map_err(cuda("event query"))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// What the handles of one device share.
struct Device {
    ctx: Arc<CudaContext>,
    /// Indexed by [`StreamKind::index`].
    streams: [Arc<CudaStream>; 2],
    /// Compute capability.
    cc: (u32, u32),
    name: String,
    /// The loaded kernels and what was loaded (`cubin sm_90`, `PTX sm_80, after: ...`).
    module: OnceLock<(Arc<CudaModule>, String)>,
    functions: Mutex<HashMap<&'static str, CudaFunction>>,
    /// Set by the first sticky (context-destroying) error: its message.
    fault: OnceLock<String>,
}

/// Driver errors after which the context is unusable (a fault in a kernel).
fn is_sticky(e: &DriverError) -> bool {
    use CUresult::*;
    matches!(
        e.0,
        CUDA_ERROR_ILLEGAL_ADDRESS
            | CUDA_ERROR_LAUNCH_TIMEOUT
            | CUDA_ERROR_ASSERT
            | CUDA_ERROR_HARDWARE_STACK_ERROR
            | CUDA_ERROR_ILLEGAL_INSTRUCTION
            | CUDA_ERROR_MISALIGNED_ADDRESS
            | CUDA_ERROR_INVALID_ADDRESS_SPACE
            | CUDA_ERROR_INVALID_PC
            | CUDA_ERROR_LAUNCH_FAILED
            | CUDA_ERROR_ECC_UNCORRECTABLE
            | CUDA_ERROR_CONTEXT_IS_DESTROYED
    )
}

impl Device {
    /// `Err` once the context has faulted (without calling the driver).
    fn alive(&self) -> Result<()> {
        match self.fault.get() {
            None => Ok(()),
            Some(first) => Err(Error::Device(format!(
                "the CUDA context is unusable since an earlier kernel fault ({first}); \
                 restart the process"
            ))),
        }
    }

    /// Maps a driver error; a sticky one marks the context faulted and is reported once.
    fn err(&self, context: &'static str) -> impl Fn(DriverError) -> Error + '_ {
        move |e| {
            if is_sticky(&e) {
                let mut first = false;
                self.fault.get_or_init(|| {
                    first = true;
                    format!("{e} at {context}")
                });
                if first {
                    eprintln!(
                        "sparsekit cuda: a kernel faulted ({e}, seen at {context}); the CUDA \
                         context of {} is unusable: every later call fails, restart the \
                         process",
                        self.name
                    );
                }
            }
            Error::backend("cuda", context, e)
        }
    }
}

/// The CUDA backend on one device: a handle on its compute or copy stream. Cheap to clone;
/// clones share the device, its streams and its buffers.
#[derive(Clone)]
pub struct CudaBackend {
    device: Arc<Device>,
    stream: StreamKind,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaBackend({}, {:?} stream)",
            self.device.name, self.stream
        )
    }
}

impl CudaBackend {
    /// Opens device `ordinal` (a handle on its compute stream). Fails with a clear message
    /// when there is no driver, no device, or no PTX for the device's arch in this binary.
    pub fn new(ordinal: usize) -> Result<Self> {
        if !driver_present() {
            return Err(Error::Device(
                "no CUDA driver (libcuda.so) on this machine; use --backend cpu or emu".into(),
            ));
        }
        if PTX.is_empty() {
            return Err(Error::Device(format!(
                "this binary carries no PTX ({PTX_BUILD_INFO}); run scripts/setup-gpu-tools.sh and rebuild"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(cuda("context creation"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(cuda("compute capability"))?;
        let (major, minor) = (major as u32, minor as u32);
        if module::candidates(major, minor).is_empty() {
            return Err(Error::Device(format!(
                "no kernels for compute capability {major}.{minor} (need sm_80+)"
            )));
        }
        let name = ctx.name().map_err(cuda("device name"))?;
        let streams = [
            ctx.new_stream().map_err(cuda("stream creation"))?,
            ctx.new_stream().map_err(cuda("stream creation"))?,
        ];
        Ok(CudaBackend {
            device: Arc::new(Device {
                ctx,
                streams,
                cc: (major, minor),
                name: format!("{name} (sm_{major}{minor})"),
                module: OnceLock::new(),
                functions: Mutex::new(HashMap::new()),
                fault: OnceLock::new(),
            }),
            stream: StreamKind::Compute,
        })
    }

    /// Device name and compute capability.
    pub fn device(&self) -> &str {
        &self.device.name
    }

    /// What the kernels were loaded from (`cubin sm_90`, or the PTX and why), loading them
    /// first if needed.
    pub fn kernel_image(&self) -> Result<String> {
        self.module().map(|(_, what)| what)
    }

    /// The kernels, loaded on first use.
    fn module(&self) -> Result<(Arc<CudaModule>, String)> {
        self.device.alive()?;
        if let Some((m, what)) = self.device.module.get() {
            return Ok((m.clone(), what.clone()));
        }
        let (major, minor) = self.device.cc;
        let loaded = module::load(&self.device.ctx, major, minor)?;
        let (m, what) = self.device.module.get_or_init(|| loaded);
        Ok((m.clone(), what.clone()))
    }

    /// The CUDA stream this handle enqueues on.
    pub fn cuda_stream(&self) -> &Arc<CudaStream> {
        &self.device.streams[self.stream.index()]
    }

    /// A timing-enabled event recorded on this handle's stream (for measurements such as
    /// the copy/compute overlap test; `record_event` events carry no timing).
    pub fn record_timing_event(&self) -> Result<CudaEvent> {
        self.cuda_stream()
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(cuda("event record"))
    }

    fn function(&self, name: &'static str) -> Result<CudaFunction> {
        let (module, _) = self.module()?;
        let mut cache = self
            .device
            .functions
            .lock()
            .map_err(|_| Error::Device("cuda function cache lock poisoned".into()))?;
        if let Some(f) = cache.get(name) {
            return Ok(f.clone());
        }
        let f = module
            .load_function(name)
            .map_err(self.device.err("function load"))?;
        cache.insert(name, f.clone());
        Ok(f)
    }
}

/// A buffer's use by one launch: recorded on the stream once the launch is enqueued.
enum UseGuard<'a> {
    Device(SyncOnDrop<'a>),
    Host(&'a HostBuffer),
}

impl<'a> UseGuard<'a> {
    fn device((addr, guard): (u64, SyncOnDrop<'a>)) -> (u64, Self) {
        (addr, UseGuard::Device(guard))
    }

    fn host(h: &'a HostBuffer, stream: &CudaStream) -> Result<(u64, Self)> {
        Ok((h.before_use(stream)?, UseGuard::Host(h)))
    }

    fn release(self, stream: &CudaStream) -> Result<()> {
        match self {
            UseGuard::Device(g) => {
                drop(g);
                Ok(())
            }
            UseGuard::Host(h) => h.after_use(stream),
        }
    }
}

impl Backend for CudaBackend {
    type Buffer = CudaBuffer;

    fn name(&self) -> &str {
        "cuda"
    }

    fn upload(&self, bytes: &[u8]) -> Result<CudaBuffer> {
        self.device.alive()?;
        if bytes.is_empty() {
            return self.alloc(0);
        }
        let s = self
            .cuda_stream()
            .clone_htod(bytes)
            .map_err(self.device.err("upload"))?;
        Ok(CudaBuffer(Memory::Device(s)))
    }

    fn alloc(&self, bytes: usize) -> Result<CudaBuffer> {
        self.device.alive()?;
        let stream = self.cuda_stream();
        let s = if bytes == 0 {
            stream.null::<u8>()
        } else {
            stream.alloc_zeros::<u8>(bytes)
        };
        Ok(CudaBuffer(Memory::Device(
            s.map_err(self.device.err("allocation"))?,
        )))
    }

    fn alloc_host(&self, bytes: usize) -> Result<CudaBuffer> {
        use cudarc::driver::sys::{CU_MEMHOSTALLOC_DEVICEMAP, CU_MEMHOSTALLOC_PORTABLE};
        self.device.alive()?;
        if bytes == 0 {
            // No 0-byte pinned allocation (the driver refuses it): an empty buffer.
            return self.alloc(0);
        }
        // SAFETY: the memory is zeroed below before anyone reads it.
        let mut s = unsafe {
            self.device.ctx.alloc_pinned_with_flags::<u8>(
                bytes,
                CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE,
            )
        }
        .map_err(cuda("host allocation"))?;
        s.as_mut_slice().map_err(cuda("host allocation"))?.fill(0);
        Ok(CudaBuffer(Memory::Host(HostBuffer::new(s))))
    }

    fn download(&self, buf: &CudaBuffer) -> Result<Vec<u8>> {
        match &buf.0 {
            Memory::Device(s) if s.is_empty() => Ok(Vec::new()),
            // Pageable destination: returns once the copy (queued behind the buffer's last
            // write, on any stream) has completed.
            Memory::Device(s) => {
                self.device.alive()?;
                self.cuda_stream()
                    .clone_dtoh(s)
                    .map_err(self.device.err("download"))
            }
            Memory::Host(h) => h.read(),
        }
    }

    fn buffer_len(&self, buf: &CudaBuffer) -> usize {
        buf.len()
    }

    fn on_stream(&self, stream: StreamKind) -> Result<Self> {
        Ok(CudaBackend {
            device: self.device.clone(),
            stream,
        })
    }

    fn stream(&self) -> StreamKind {
        self.stream
    }

    fn record_event(&self) -> Result<Event> {
        self.device.alive()?;
        let e = self
            .cuda_stream()
            .record_event(None)
            .map_err(self.device.err("event record"))?;
        Ok(Event::pending(Arc::new(CudaMarker(e))))
    }

    fn wait_event(&self, event: &Event) -> Result<()> {
        let Some(d) = event.device() else {
            return Ok(());
        };
        match d.as_any().downcast_ref::<CudaMarker>() {
            Some(m) if *m.0.context() == self.device.ctx => {
                self.device.alive()?;
                self.cuda_stream()
                    .wait(&m.0)
                    .map_err(self.device.err("event wait"))
            }
            // Another device's or backend's event: the host waits for it.
            _ => event.wait(Event::DEFAULT_TIMEOUT),
        }
    }

    fn synchronize(&self) -> Result<()> {
        self.device.alive()?;
        let e = self
            .cuda_stream()
            .record_event(None)
            .map_err(self.device.err("event record"))?;
        wait_host(&e, self.device.err("synchronize"))?;
        self.device
            .ctx
            .check_err()
            .map_err(self.device.err("deferred error"))
    }

    sparsekit_host::kernel_backend_ops!();
}

// SAFETY: metadata is uploaded to device memory freed stream-ordered after the launches
// that read it; buffer addresses come from cudarc (device memory, whose read/write events
// order uses across streams and whose free waits for them) or from `HostBuffer` (mapped
// memory with its own last-use event, waited for before reads and before the free);
// `enqueue` launches `P::ENTRY` with `params.launch()`.
unsafe impl KernelDevice for CudaBackend {
    type Staged<'a> = CudaSlice<u8>;

    /// Not filled: the kernels write every scratch byte before reading it (checked by the
    /// emulator), and the counters that must start at zero come from [`Backend::alloc`].
    fn alloc_scratch(&self, bytes: usize) -> Result<CudaBuffer> {
        self.device.alive()?;
        let stream = self.cuda_stream();
        let s = if bytes == 0 {
            stream.null::<u8>()
        } else {
            // SAFETY: device bytes of unspecified value (any bit pattern is a valid u8);
            // what the caller reads before writing is unspecified, never undefined.
            unsafe { stream.alloc::<u8>(bytes) }
        };
        Ok(CudaBuffer(Memory::Device(
            s.map_err(self.device.err("allocation"))?,
        )))
    }

    fn stage(&self, bytes: &[u8]) -> Result<CudaSlice<u8>> {
        self.device.alive()?;
        let stream = self.cuda_stream();
        if bytes.is_empty() {
            return stream
                .null::<u8>()
                .map_err(self.device.err("metadata upload"));
        }
        // Freed (stream-ordered, after the launch that reads it) when dropped.
        stream
            .clone_htod(bytes)
            .map_err(self.device.err("metadata upload"))
    }

    fn staged_addr(&self, staged: &CudaSlice<u8>) -> u64 {
        let (p, _read) = staged.device_ptr(self.cuda_stream());
        p
    }

    fn with_addrs<R>(
        &self,
        reads: &[&CudaBuffer],
        writes: &mut [&mut CudaBuffer],
        f: impl FnOnce(&[u64], &[u64]) -> R,
    ) -> Result<R> {
        self.device.alive()?;
        let stream = self.cuda_stream();
        // Device buffers: the stream waits for the buffer's last write (a read) or for
        // every earlier use (a write), and the guard records this use once the launch is
        // enqueued. Host buffers: see `HostBuffer`.
        let ctx = &self.device.ctx;
        let foreign = || Error::InvalidArgument {
            what: "buffer",
            detail: "device memory of another CUDA device (context)".into(),
        };
        let reads = reads.iter().map(|b| match &b.0 {
            Memory::Device(s) if s.context() != ctx => Err(foreign()),
            Memory::Device(s) => Ok(UseGuard::device(s.device_ptr(stream))),
            Memory::Host(h) => UseGuard::host(h, stream),
        });
        let writes = writes.iter_mut().map(|b| match &mut b.0 {
            Memory::Device(s) if s.context() != ctx => Err(foreign()),
            Memory::Device(s) => Ok(UseGuard::device(s.device_ptr_mut(stream))),
            Memory::Host(h) => UseGuard::host(h, stream),
        });
        let (r, rg): (Vec<u64>, Vec<UseGuard<'_>>) =
            reads.collect::<Result<Vec<_>>>()?.into_iter().unzip();
        let (w, wg): (Vec<u64>, Vec<UseGuard<'_>>) =
            writes.collect::<Result<Vec<_>>>()?.into_iter().unzip();
        let out = f(&r, &w);
        for g in rg.into_iter().chain(wg) {
            g.release(stream)?;
        }
        Ok(out)
    }

    unsafe fn enqueue<P: KernelParams>(&self, params: P, _spans: &[Span]) -> Result<()> {
        self.device.alive()?;
        let l = params.launch();
        let f = self.function(P::ENTRY)?;
        if l.smem_bytes > DEFAULT_DYN_SMEM {
            // Above the default a kernel must opt in to its dynamic shared memory.
            f.set_attribute(
                CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                l.smem_bytes as i32,
            )
            .map_err(self.device.err("shared memory attribute"))?;
        }
        let p = Param(params);
        let mut b = self.cuda_stream().launch_builder(&f);
        b.arg(&p);
        let cfg = LaunchConfig {
            grid_dim: (l.grid, 1, 1),
            block_dim: (l.block, 1, 1),
            shared_mem_bytes: l.smem_bytes,
        };
        // SAFETY: the caller's contract: `params` holds addresses of buffers and staged
        // metadata that stay valid until the kernel completes (the buffers' frees are
        // ordered after their recorded uses; staged metadata is freed on this stream after
        // the launch), filled from validated descriptors; the geometry is the kernel's own
        // (`P::launch`), with the shared memory limit raised above the default.
        unsafe { b.launch(cfg) }.map_err(self.device.err("launch"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_faults_are_sticky_other_errors_are_not() {
        for c in [
            CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
            CUresult::CUDA_ERROR_MISALIGNED_ADDRESS,
            CUresult::CUDA_ERROR_LAUNCH_FAILED,
            CUresult::CUDA_ERROR_ASSERT,
        ] {
            assert!(is_sticky(&DriverError(c)), "{c:?}");
        }
        for c in [
            CUresult::CUDA_ERROR_OUT_OF_MEMORY,
            CUresult::CUDA_ERROR_INVALID_VALUE,
            CUresult::CUDA_ERROR_NOT_READY,
        ] {
            assert!(!is_sticky(&DriverError(c)), "{c:?}");
        }
    }
}
