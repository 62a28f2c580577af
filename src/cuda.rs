//! The CUDA backend: the embedded PTX run through cudarc (driver API, loaded dynamically,
//! so building needs no CUDA toolkit and a machine without a driver gets a clear error).
//!
//! One context and stream per backend; the module for the device's compute capability is
//! loaded lazily on first use and its functions cached. Host metadata (slots, page ids) is
//! uploaded per call; bulk tensors live in [`CudaBuffer`]s. Every op runs its
//! `sparsekit-kernels` kernel with the same launch geometry as the emulator.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
    DeviceRepr, LaunchConfig, PinnedHostSlice, PushKernelArg, SyncOnDrop,
};
use sparsekit_host::ops::{
    CopyPages, IndexKStore, IndexerLogits, KvStore, Op, PageChecksums, QueryRange, SparseMla, Topk,
    TopkOutput,
};
use sparsekit_host::{kernel_params, Backend, Error, Result};
use sparsekit_kernels::kernels;
use sparsekit_kernels::launch::{self, Launch};

use crate::ptx::{ptx_for_device, PTX, PTX_BUILD_INFO};

/// Memory the kernels can address: device memory, or page-locked device-mapped host
/// memory (host cache tiers; kernels reach it over PCIe through unified addressing).
#[derive(Debug)]
pub enum CudaBuffer {
    Device(CudaSlice<u8>),
    Host(PinnedHostSlice<u8>),
}

impl CudaBuffer {
    fn len(&self) -> usize {
        match self {
            CudaBuffer::Device(s) => s.len(),
            CudaBuffer::Host(s) => s.len(),
        }
    }
}

/// A device address of a buffer, valid while the guard lives.
struct Addr<'a>(u64, #[allow(dead_code)] Option<SyncOnDrop<'a>>);

impl CudaBackend {
    fn addr<'a>(&'a self, b: &'a CudaBuffer) -> Result<Addr<'a>> {
        match b {
            CudaBuffer::Device(s) => {
                let (p, g) = s.device_ptr(&self.stream);
                Ok(Addr(p, Some(g)))
            }
            // With unified addressing, DEVICEMAP host memory has the same address on the
            // device; the stream is synchronised after every launch that uses it.
            CudaBuffer::Host(s) => Ok(Addr(s.as_ptr().map_err(dev)? as u64, None)),
        }
    }

    fn addr_mut<'a>(&'a self, b: &'a mut CudaBuffer) -> Result<Addr<'a>> {
        match b {
            CudaBuffer::Device(s) => {
                let (p, g) = s.device_ptr_mut(&self.stream);
                Ok(Addr(p, Some(g)))
            }
            CudaBuffer::Host(s) => Ok(Addr(s.as_mut_ptr().map_err(dev)? as u64, None)),
        }
    }
}

/// A kernel parameter struct passed by value.
#[repr(transparent)]
struct Param<T>(T);

// SAFETY: the kernel parameter structs are `#[repr(C)]` plain data (integers and device
// addresses) whose layout the PTX entry points declare identically (defined once in
// sparsekit-kernels).
unsafe impl<T: Copy> DeviceRepr for Param<T> {}

fn dev(e: impl std::fmt::Display) -> Error {
    Error::Device(e.to_string())
}

/// The CUDA backend on one device.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: &'static str,
    ptx: &'static str,
    device_name: String,
    module: OnceLock<Arc<CudaModule>>,
    functions: Mutex<HashMap<&'static str, CudaFunction>>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaBackend({}, {})", self.device_name, self.arch)
    }
}

/// Whether the CUDA driver library can be loaded (probed before cudarc touches it, since
/// cudarc panics when it is missing).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen libcuda; no driver call is made.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

impl CudaBackend {
    /// Opens device `ordinal`. Fails with a clear message when there is no driver, no
    /// device, or no PTX for the device's arch in this binary.
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
        let ctx = CudaContext::new(ordinal).map_err(dev)?;
        let (major, minor) = ctx.compute_capability().map_err(dev)?;
        let (arch, ptx) = ptx_for_device(major as u32, minor as u32).ok_or_else(|| {
            Error::Device(format!(
                "no PTX for compute capability {major}.{minor} (need sm_80+)"
            ))
        })?;
        let device_name = ctx.name().map_err(dev)?;
        Ok(CudaBackend {
            stream: ctx.default_stream(),
            ctx,
            arch,
            ptx,
            device_name: format!("{device_name} (sm_{major}{minor}, PTX {arch})"),
            module: OnceLock::new(),
            functions: Mutex::new(HashMap::new()),
        })
    }

    /// Device name, compute capability and the PTX arch in use.
    pub fn device(&self) -> &str {
        &self.device_name
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(dev)
    }

    fn function(&self, name: &'static str) -> Result<CudaFunction> {
        let mut cache = self
            .functions
            .lock()
            .map_err(|_| dev("function cache poisoned"))?;
        if let Some(f) = cache.get(name) {
            return Ok(f.clone());
        }
        let module = match self.module.get() {
            Some(m) => m.clone(),
            None => {
                let m = self
                    .ctx
                    .load_module(cudarc::nvrtc::Ptx::from_src(self.ptx))
                    .map_err(dev)?;
                self.module.get_or_init(|| m).clone()
            }
        };
        let f = module.load_function(name).map_err(dev)?;
        cache.insert(name, f.clone());
        Ok(f)
    }

    fn launch<P: Copy>(&self, name: &'static str, l: Launch, params: P) -> Result<()> {
        let f = self.function(name)?;
        if l.smem_bytes > 48 * 1024 {
            // Above 48 KiB a kernel must opt in to its dynamic shared memory.
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                l.smem_bytes as i32,
            )
            .map_err(dev)?;
        }
        let p = Param(params);
        let mut b = self.stream.launch_builder(&f);
        b.arg(&p);
        let cfg = LaunchConfig {
            grid_dim: (l.grid, 1, 1),
            block_dim: (l.block, 1, 1),
            shared_mem_bytes: l.smem_bytes,
        };
        // SAFETY: `params` was built by the caller from validated descriptors and buffers
        // that outlive the launch (the stream is synchronised before they are dropped or
        // read back); the geometry comes from `sparsekit_kernels::launch`.
        unsafe { b.launch(cfg) }.map_err(dev)?;
        Ok(())
    }

    fn upload_slice<T: DeviceRepr>(&self, v: &[T]) -> Result<CudaSlice<T>> {
        self.stream.clone_htod(v).map_err(dev)
    }
}

impl Backend for CudaBackend {
    type Buffer = CudaBuffer;

    fn name(&self) -> &str {
        "cuda"
    }

    fn supports(&self, op: Op) -> bool {
        // Every op has a kernel.
        let _ = op;
        true
    }

    fn upload(&self, bytes: &[u8]) -> Result<CudaBuffer> {
        Ok(CudaBuffer::Device(
            self.stream.clone_htod(bytes).map_err(dev)?,
        ))
    }

    fn alloc(&self, bytes: usize) -> Result<CudaBuffer> {
        Ok(CudaBuffer::Device(
            self.stream.alloc_zeros::<u8>(bytes).map_err(dev)?,
        ))
    }

    fn alloc_host(&self, bytes: usize) -> Result<CudaBuffer> {
        use cudarc::driver::sys::{CU_MEMHOSTALLOC_DEVICEMAP, CU_MEMHOSTALLOC_PORTABLE};
        // SAFETY: the memory is zeroed below before anyone reads it.
        let mut s = unsafe {
            self.ctx.alloc_pinned_with_flags::<u8>(
                bytes,
                CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE,
            )
        }
        .map_err(dev)?;
        s.as_mut_slice().map_err(dev)?.fill(0);
        Ok(CudaBuffer::Host(s))
    }

    fn download(&self, buf: &CudaBuffer) -> Result<Vec<u8>> {
        match buf {
            CudaBuffer::Device(s) => self.stream.clone_dtoh(s).map_err(dev),
            CudaBuffer::Host(s) => Ok(s.as_slice().map_err(dev)?.to_vec()),
        }
    }

    fn buffer_len(&self, buf: &CudaBuffer) -> usize {
        buf.len()
    }

    fn index_k_store(
        &self,
        op: &IndexKStore<'_>,
        keys: &CudaBuffer,
        cache: &mut CudaBuffer,
    ) -> Result<()> {
        op.validate(keys.len(), cache.len())?;
        let slots = self.upload_slice(op.slots)?;
        let k = self.addr(keys)?;
        let (sp, _s) = slots.device_ptr(&self.stream);
        let c = self.addr_mut(cache)?;
        let params = kernel_params::index_k_store(
            &op.layout,
            k.0 as *const u16,
            sp as *const i64,
            c.0 as *mut u8,
            op.slots.len(),
        );
        self.launch("index_k_store", launch::store(params.n_tokens), params)?;
        self.synchronize()
    }

    fn kv_store(&self, op: &KvStore<'_>, kv: &CudaBuffer, cache: &mut CudaBuffer) -> Result<()> {
        op.validate(kv.len(), cache.len())?;
        let slots = self.upload_slice(op.slots)?;
        let k = self.addr(kv)?;
        let (sp, _s) = slots.device_ptr(&self.stream);
        let c = self.addr_mut(cache)?;
        let params = kernel_params::kv_store(
            &op.layout,
            k.0 as *const u16,
            sp as *const i64,
            c.0 as *mut u8,
            op.slots.len(),
        );
        self.launch("kv_store", launch::store(params.n_tokens), params)?;
        self.synchronize()
    }

    fn indexer_logits(
        &self,
        op: &IndexerLogits<'_>,
        q: &CudaBuffer,
        weights: &CudaBuffer,
        cache: &CudaBuffer,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        op.validate(q.len(), weights.len(), cache.len(), out.len())?;
        kernel_params::check_indexer(op)?;
        if op.rows.is_empty() || op.row_stride == 0 {
            return Ok(());
        }
        let table = self.upload_slice(op.page_table.as_slice())?;
        let rows = self.upload_slice(bytemuck::cast_slice::<QueryRange, u32>(&op.rows))?;
        let (qa, wa, ca) = (self.addr(q)?, self.addr(weights)?, self.addr(cache)?);
        let (ta, _t) = table.device_ptr(&self.stream);
        let (ra, _r) = rows.device_ptr(&self.stream);
        let o = self.addr_mut(out)?;
        let params = kernel_params::indexer_logits(
            op,
            qa.0 as *const u16,
            wa.0 as *const f32,
            ca.0 as *const u8,
            ta as *const i32,
            ra as *const u32,
            o.0 as *mut f32,
        );
        let l =
            kernel_params::check_launch("indexer_logits", kernels::indexer_logits_launch(&params))?;
        self.launch("indexer_logits", l, params)?;
        self.synchronize()
    }

    fn topk(&self, op: &Topk<'_>, logits: &CudaBuffer, out: &mut CudaBuffer) -> Result<()> {
        op.validate(logits.len(), out.len())?;
        if op.rows.is_empty() {
            return Ok(());
        }
        let table: Option<CudaSlice<i32>> = match op.output {
            TopkOutput::Slots { page_table, .. } => Some(self.upload_slice(page_table.as_slice())?),
            TopkOutput::Positions => None,
        };
        let rows = self.upload_slice(bytemuck::cast_slice::<QueryRange, u32>(op.rows))?;
        let la = self.addr(logits)?;
        let t = table.as_ref().map(|t| t.device_ptr(&self.stream));
        let (ra, _r) = rows.device_ptr(&self.stream);
        let o = self.addr_mut(out)?;
        let params = kernel_params::topk(
            op,
            la.0 as *const f32,
            ra as *const u32,
            t.as_ref()
                .map_or(std::ptr::null(), |(p, _)| *p as *const i32),
            o.0 as *mut i32,
        );
        let l = kernel_params::check_launch("topk", kernels::topk_launch(&params))?;
        self.launch("topk", l, params)?;
        self.synchronize()
    }

    /// The indices are device data; they are downloaded and checked against the cache
    /// before the launch (an out-of-range slot is an error, never a wild read).
    fn sparse_mla(
        &self,
        op: &SparseMla,
        q: &CudaBuffer,
        cache: &CudaBuffer,
        indices: &CudaBuffer,
        out: &mut CudaBuffer,
        lse: &mut CudaBuffer,
    ) -> Result<()> {
        let pages = op.validate(q.len(), cache.len(), indices.len(), out.len(), lse.len())?;
        let host_idx: Vec<i32> = bytemuck::pod_collect_to_vec(&self.download(indices)?);
        op.check_indices(&host_idx, pages)?;
        if op.n_tokens == 0 {
            return Ok(());
        }
        let (qa, ca, ia) = (self.addr(q)?, self.addr(cache)?, self.addr(indices)?);
        let o = self.addr_mut(out)?;
        let l = self.addr_mut(lse)?;
        let params = kernel_params::sparse_mla(
            op,
            qa.0 as *const u16,
            ca.0 as *const u8,
            ia.0 as *const i32,
            o.0 as *mut u16,
            l.0 as *mut f32,
        );
        let g = kernel_params::check_launch("sparse_mla", kernels::sparse_mla_launch(&params))?;
        self.launch("sparse_mla", g, params)?;
        self.synchronize()
    }

    fn copy_pages(&self, op: &CopyPages<'_>, src: &CudaBuffer, dst: &mut CudaBuffer) -> Result<()> {
        op.validate(src.len(), dst.len())?;
        if op.src_ids.is_empty() {
            return Ok(());
        }
        let src_ids = self.upload_slice(op.src_ids)?;
        let dst_ids = self.upload_slice(op.dst_ids)?;
        let s = self.addr(src)?;
        let d = self.addr_mut(dst)?;
        let (si, _si) = src_ids.device_ptr(&self.stream);
        let (di, _di) = dst_ids.device_ptr(&self.stream);
        let params = kernel_params::copy_pages(
            op,
            s.0 as *const u8,
            d.0 as *mut u8,
            si as *const i32,
            di as *const i32,
        );
        self.launch("copy_pages", launch::copy_pages(params.n_pages), params)?;
        self.synchronize()
    }

    fn page_checksums(
        &self,
        op: &PageChecksums<'_>,
        pool: &CudaBuffer,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        op.validate(pool.len(), out.len())?;
        if op.ids.is_empty() {
            return Ok(());
        }
        let ids = self.upload_slice(op.ids)?;
        let p = self.addr(pool)?;
        let (i, _i) = ids.device_ptr(&self.stream);
        let o = self.addr_mut(out)?;
        let params =
            kernel_params::page_checksums(op, p.0 as *const u8, i as *const i32, o.0 as *mut u64);
        self.launch(
            "page_checksums",
            launch::page_checksums(params.n_pages),
            params,
        )?;
        self.synchronize()
    }
}
