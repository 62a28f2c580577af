//! The `emu` backend: the GPU kernels of `sparsekit-kernels`, unchanged, run on the host
//! by the SIMT emulator, over host buffers. Slow, and meant for validation: it catches
//! index-arithmetic bugs and barrier/warp misuse of the real kernels without a GPU.
//!
//! Launch geometry comes from `sparsekit_kernels::launch`, exactly as on the GPU. Ops
//! without a kernel yet report `NotImplemented` (and `supports` says so).

use sparsekit_kernels::emu::{launch, Emu, EmuError, LaunchConfig, Params};
use sparsekit_kernels::kernels;
use sparsekit_kernels::launch::{self as geometry, Launch};
use sparsekit_kernels::params::{
    index_k_format, kv_format, CopyPagesParams, IndexKStoreParams, KvStoreParams,
    PageChecksumsParams,
};

use crate::backend::Backend;
use crate::cpu::CpuBuffer;
use crate::dtype::ScaleFormat;
use crate::error::{Error, Result};
use crate::layout::{IndexKDtype, KvDtype};
use crate::ops::{
    CopyPages, IndexKStore, IndexerLogits, KvStore, Op, PageChecksums, SparseMla, Topk,
};

/// The emulator backend.
#[derive(Clone, Copy, Debug, Default)]
pub struct EmuBackend;

impl EmuBackend {
    /// A new emulator backend.
    pub fn new() -> Self {
        EmuBackend
    }
}

fn emu_err(kernel: &str, e: EmuError) -> Error {
    Error::Device(format!("emulator, kernel {kernel}: {e}"))
}

fn config(l: Launch) -> LaunchConfig {
    LaunchConfig {
        grid: l.grid,
        block: l.block,
        dyn_smem_bytes: l.smem_bytes as usize,
    }
}

fn not_implemented(op: &'static str) -> Error {
    Error::NotImplemented {
        backend: "emu".into(),
        op,
    }
}

impl Backend for EmuBackend {
    type Buffer = CpuBuffer;

    fn name(&self) -> &str {
        "emu"
    }

    fn supports(&self, op: Op) -> bool {
        matches!(
            op,
            Op::IndexKStore | Op::KvStore | Op::CopyPages | Op::PageChecksums
        )
    }

    fn upload(&self, bytes: &[u8]) -> Result<CpuBuffer> {
        Ok(CpuBuffer::from_bytes(bytes))
    }

    fn alloc(&self, bytes: usize) -> Result<CpuBuffer> {
        Ok(CpuBuffer::zeroed(bytes))
    }

    fn alloc_host(&self, bytes: usize) -> Result<CpuBuffer> {
        Ok(CpuBuffer::zeroed(bytes))
    }

    fn download(&self, buf: &CpuBuffer) -> Result<Vec<u8>> {
        Ok(buf.bytes().to_vec())
    }

    fn buffer_len(&self, buf: &CpuBuffer) -> usize {
        buf.len()
    }

    fn index_k_store(
        &self,
        op: &IndexKStore<'_>,
        keys: &CpuBuffer,
        cache: &mut CpuBuffer,
    ) -> Result<()> {
        op.validate(keys.len(), cache.len())?;
        let l = op.layout;
        let p = IndexKStoreParams {
            keys: keys.typed::<u16>("keys")?.as_ptr(),
            slots: op.slots.as_ptr(),
            cache: cache.bytes_mut().as_mut_ptr(),
            n_tokens: op.slots.len() as u32,
            head_dim: l.head_dim() as u32,
            page_size: l.page_size() as u32,
            format: match l.dtype() {
                IndexKDtype::Bf16 => index_k_format::BF16,
                IndexKDtype::Fp8E4m3 {
                    scale: ScaleFormat::Fp32,
                } => index_k_format::FP8_FP32_SCALE,
                IndexKDtype::Fp8E4m3 {
                    scale: ScaleFormat::Ue8m0,
                } => index_k_format::FP8_UE8M0_SCALE,
            },
            page_bytes: l.bytes_per_page() as u64,
            value_bytes: l.value_bytes_per_token() as u32,
            scale_offset: l.scale_section_offset().unwrap_or(0) as u32,
        };
        // SAFETY: the pointers come from buffers validated against the layout and borrowed
        // for the whole (synchronous) launch; slots are unique and in range (validated).
        let p = unsafe { Params::new(p) };
        let cfg = config(geometry::store(op.slots.len() as u32));
        // SAFETY: the kernel's contract holds (see above; the store geometry uses
        // whole warps).
        launch(cfg, || unsafe { kernels::index_k_store::<Emu>(p.get()) })
            .map_err(|e| emu_err("index_k_store", e))
    }

    fn kv_store(&self, op: &KvStore<'_>, kv: &CpuBuffer, cache: &mut CpuBuffer) -> Result<()> {
        op.validate(kv.len(), cache.len())?;
        let l = op.layout;
        let p = KvStoreParams {
            kv: kv.typed::<u16>("kv")?.as_ptr(),
            slots: op.slots.as_ptr(),
            cache: cache.bytes_mut().as_mut_ptr(),
            n_tokens: op.slots.len() as u32,
            nope_dim: l.nope_dim() as u32,
            rope_dim: l.rope_dim() as u32,
            page_size: l.page_size() as u32,
            format: match l.dtype() {
                KvDtype::Bf16 => kv_format::BF16,
                KvDtype::Fp8DsMla => kv_format::FP8_DS_MLA,
            },
            token_bytes: l.bytes_per_token() as u32,
            page_bytes: l.bytes_per_page() as u64,
            scales_offset: l.scales_range().start as u32,
            rope_offset: l.rope_range().start as u32,
        };
        // SAFETY: as in `index_k_store`.
        let p = unsafe { Params::new(p) };
        let cfg = config(geometry::store(op.slots.len() as u32));
        // SAFETY: the kernel's contract holds (validated descriptor and buffers).
        launch(cfg, || unsafe { kernels::kv_store::<Emu>(p.get()) })
            .map_err(|e| emu_err("kv_store", e))
    }

    fn indexer_logits(
        &self,
        _: &IndexerLogits<'_>,
        _: &CpuBuffer,
        _: &CpuBuffer,
        _: &CpuBuffer,
        _: &mut CpuBuffer,
    ) -> Result<()> {
        Err(not_implemented("indexer_logits"))
    }

    fn topk(&self, _: &Topk<'_>, _: &CpuBuffer, _: &mut CpuBuffer) -> Result<()> {
        Err(not_implemented("topk"))
    }

    fn sparse_mla(
        &self,
        _: &SparseMla,
        _: &CpuBuffer,
        _: &CpuBuffer,
        _: &CpuBuffer,
        _: &mut CpuBuffer,
        _: &mut CpuBuffer,
    ) -> Result<()> {
        Err(not_implemented("sparse_mla"))
    }

    fn copy_pages(&self, op: &CopyPages<'_>, src: &CpuBuffer, dst: &mut CpuBuffer) -> Result<()> {
        op.validate(src.len(), dst.len())?;
        if op.src_ids.is_empty() {
            return Ok(());
        }
        let p = CopyPagesParams {
            src: src.bytes()[op.src.offset..].as_ptr(),
            dst: dst.bytes_mut()[op.dst.offset..].as_mut_ptr(),
            src_ids: op.src_ids.as_ptr(),
            dst_ids: op.dst_ids.as_ptr(),
            src_stride: op.src.stride as u64,
            dst_stride: op.dst.stride as u64,
            bytes: op.src.layout.bytes_per_page() as u64,
            n_pages: op.src_ids.len() as u32,
            _pad: 0,
        };
        // SAFETY: ids validated against both regions, destinations unique, buffers distinct
        // and borrowed for the launch.
        let p = unsafe { Params::new(p) };
        let cfg = config(geometry::copy_pages(op.src_ids.len() as u32));
        // SAFETY: the kernel's contract holds (see above).
        launch(cfg, || unsafe { kernels::copy_pages::<Emu>(p.get()) })
            .map_err(|e| emu_err("copy_pages", e))
    }

    fn page_checksums(
        &self,
        op: &PageChecksums<'_>,
        pool: &CpuBuffer,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        op.validate(pool.len(), out.len())?;
        if op.ids.is_empty() {
            return Ok(());
        }
        let p = PageChecksumsParams {
            pool: pool.bytes()[op.region.offset..].as_ptr(),
            ids: op.ids.as_ptr(),
            out: out.typed_mut::<u64>("checksums")?.as_mut_ptr(),
            stride: op.region.stride as u64,
            bytes: op.region.layout.bytes_per_page() as u64,
            n_pages: op.ids.len() as u32,
            _pad: 0,
        };
        // SAFETY: ids validated against the region; `out` holds one u64 per id.
        let p = unsafe { Params::new(p) };
        let cfg = config(geometry::page_checksums(op.ids.len() as u32));
        // SAFETY: the kernel's contract holds; the geometry provides the shared memory.
        launch(cfg, || unsafe { kernels::page_checksums::<Emu>(p.get()) })
            .map_err(|e| emu_err("page_checksums", e))
    }
}
