//! The CUDA backend: the embedded PTX run through cudarc (driver API, loaded dynamically,
//! so building needs no CUDA toolkit and a machine without a driver gets a clear error).
//!
//! One context per device with two non-blocking streams, compute and copy
//! ([`StreamKind`]); a [`CudaBackend`] value is a handle on one of them
//! ([`Backend::on_stream`]). The module for the device's compute capability is loaded
//! lazily on first use and its functions cached.
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

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::sys::{CUevent_flags, CUfunction_attribute_enum};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr,
    DevicePtrMut, DeviceRepr, DriverError, LaunchConfig, PushKernelArg, SyncOnDrop,
};
use sparsekit_host::backend::DeviceEvent;
use sparsekit_host::launcher::{KernelDevice, Span};
use sparsekit_host::{Backend, Error, Event, Result, StreamKind};
use sparsekit_kernels::launch::{KernelParams, DEFAULT_DYN_SMEM};

use crate::ptx::{ptx_for_device, PTX, PTX_BUILD_INFO};

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
/// bounded whatever the event's flags).
fn wait_host(e: &CudaEvent) -> Result<()> {
    let start = Instant::now();
    let mut pause = Duration::from_micros(2);
    while !e.try_is_complete().map_err(cuda("event query"))? {
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
    arch: &'static str,
    ptx: &'static str,
    name: String,
    module: OnceLock<Arc<CudaModule>>,
    functions: Mutex<HashMap<&'static str, CudaFunction>>,
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
            "CudaBackend({}, {}, {:?} stream)",
            self.device.name, self.device.arch, self.stream
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
        let (arch, ptx) = ptx_for_device(major as u32, minor as u32).ok_or_else(|| {
            Error::Device(format!(
                "no PTX for compute capability {major}.{minor} (need sm_80+)"
            ))
        })?;
        let name = ctx.name().map_err(cuda("device name"))?;
        let streams = [
            ctx.new_stream().map_err(cuda("stream creation"))?,
            ctx.new_stream().map_err(cuda("stream creation"))?,
        ];
        Ok(CudaBackend {
            device: Arc::new(Device {
                ctx,
                streams,
                arch,
                ptx,
                name: format!("{name} (sm_{major}{minor}, PTX {arch})"),
                module: OnceLock::new(),
                functions: Mutex::new(HashMap::new()),
            }),
            stream: StreamKind::Compute,
        })
    }

    /// Device name, compute capability and the PTX arch in use.
    pub fn device(&self) -> &str {
        &self.device.name
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
        let mut cache = self
            .device
            .functions
            .lock()
            .map_err(|_| Error::Device("cuda function cache lock poisoned".into()))?;
        if let Some(f) = cache.get(name) {
            return Ok(f.clone());
        }
        let module = match self.device.module.get() {
            Some(m) => m.clone(),
            None => {
                let m = self
                    .device
                    .ctx
                    .load_module(cudarc::nvrtc::Ptx::from_src(self.device.ptx))
                    .map_err(cuda("module load"))?;
                self.device.module.get_or_init(|| m).clone()
            }
        };
        let f = module.load_function(name).map_err(cuda("function load"))?;
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
        if bytes.is_empty() {
            return self.alloc(0);
        }
        let s = self
            .cuda_stream()
            .clone_htod(bytes)
            .map_err(cuda("upload"))?;
        Ok(CudaBuffer(Memory::Device(s)))
    }

    fn alloc(&self, bytes: usize) -> Result<CudaBuffer> {
        let stream = self.cuda_stream();
        let s = if bytes == 0 {
            stream.null::<u8>()
        } else {
            stream.alloc_zeros::<u8>(bytes)
        };
        Ok(CudaBuffer(Memory::Device(s.map_err(cuda("allocation"))?)))
    }

    fn alloc_host(&self, bytes: usize) -> Result<CudaBuffer> {
        use cudarc::driver::sys::{CU_MEMHOSTALLOC_DEVICEMAP, CU_MEMHOSTALLOC_PORTABLE};
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
            Memory::Device(s) => self.cuda_stream().clone_dtoh(s).map_err(cuda("download")),
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
        let e = self
            .cuda_stream()
            .record_event(None)
            .map_err(cuda("event record"))?;
        Ok(Event::pending(Arc::new(CudaMarker(e))))
    }

    fn wait_event(&self, event: &Event) -> Result<()> {
        let Some(d) = event.device() else {
            return Ok(());
        };
        match d.as_any().downcast_ref::<CudaMarker>() {
            Some(m) if *m.0.context() == self.device.ctx => {
                self.cuda_stream().wait(&m.0).map_err(cuda("event wait"))
            }
            // Another device's or backend's event: the host waits for it.
            _ => event.wait(Event::DEFAULT_TIMEOUT),
        }
    }

    fn synchronize(&self) -> Result<()> {
        let e = self
            .cuda_stream()
            .record_event(None)
            .map_err(cuda("event record"))?;
        wait_host(&e)?;
        self.device.ctx.check_err().map_err(cuda("deferred error"))
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

    fn stage(&self, bytes: &[u8]) -> Result<CudaSlice<u8>> {
        let stream = self.cuda_stream();
        if bytes.is_empty() {
            return stream.null::<u8>().map_err(cuda("metadata upload"));
        }
        // Freed (stream-ordered, after the launch that reads it) when dropped.
        stream.clone_htod(bytes).map_err(cuda("metadata upload"))
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
        let l = params.launch();
        let f = self.function(P::ENTRY)?;
        if l.smem_bytes > DEFAULT_DYN_SMEM {
            // Above the default a kernel must opt in to its dynamic shared memory.
            f.set_attribute(
                CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                l.smem_bytes as i32,
            )
            .map_err(cuda("shared memory attribute"))?;
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
        unsafe { b.launch(cfg) }.map_err(cuda("launch"))?;
        Ok(())
    }
}
