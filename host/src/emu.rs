//! The `emu` backend: the GPU kernels of `sparsekit-kernels`, unchanged, run on the host
//! by the SIMT emulator, over host buffers. Slow, and meant for validation: it catches
//! index-arithmetic bugs and barrier/warp misuse of the real kernels without a GPU.
//!
//! Launch geometry comes from `sparsekit_kernels` (the same functions the CUDA launcher
//! uses), so the emulator runs exactly the blocks the GPU runs.

use sparsekit_kernels::emu::{launch, Emu, EmuError, LaunchConfig, Params};
use sparsekit_kernels::kernels;
use sparsekit_kernels::launch::{self as geometry, Launch};

use crate::backend::Backend;
use crate::cpu::CpuBuffer;
use crate::error::{Error, Result};
use crate::kernel_params;
use crate::ops::{
    CopyPages, IndexKStore, IndexerLogits, KvStore, Op, PageChecksums, QueryRange, SparseMla, Topk,
    TopkOutput,
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

impl Backend for EmuBackend {
    type Buffer = CpuBuffer;

    fn name(&self) -> &str {
        "emu"
    }

    fn supports(&self, op: Op) -> bool {
        // Every op has a kernel.
        let _ = op;
        true
    }

    crate::cpu::buffer::host_buffer_methods!();

    fn index_k_store(
        &self,
        op: &IndexKStore<'_>,
        keys: &CpuBuffer,
        cache: &mut CpuBuffer,
    ) -> Result<()> {
        op.validate(keys.len(), cache.len())?;
        let p = kernel_params::index_k_store(
            &op.layout,
            keys.typed::<u16>("keys")?.as_ptr(),
            op.slots.as_ptr(),
            cache.bytes_mut().as_mut_ptr(),
            op.slots.len(),
        );
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
        let p = kernel_params::kv_store(
            &op.layout,
            kv.typed::<u16>("kv")?.as_ptr(),
            op.slots.as_ptr(),
            cache.bytes_mut().as_mut_ptr(),
            op.slots.len(),
        );
        // SAFETY: as in `index_k_store`.
        let p = unsafe { Params::new(p) };
        let cfg = config(geometry::store(op.slots.len() as u32));
        // SAFETY: the kernel's contract holds (validated descriptor and buffers).
        launch(cfg, || unsafe { kernels::kv_store::<Emu>(p.get()) })
            .map_err(|e| emu_err("kv_store", e))
    }

    fn indexer_logits(
        &self,
        op: &IndexerLogits<'_>,
        q: &CpuBuffer,
        weights: &CpuBuffer,
        cache: &CpuBuffer,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        op.validate(q.len(), weights.len(), cache.len(), out.len())?;
        kernel_params::check_indexer(op)?;
        if op.rows.is_empty() || op.row_stride == 0 {
            return Ok(());
        }
        let p = kernel_params::indexer_logits(
            op,
            q.typed::<u16>("q")?.as_ptr(),
            weights.typed::<f32>("weights")?.as_ptr(),
            cache.bytes().as_ptr(),
            op.page_table.as_slice().as_ptr(),
            bytemuck::cast_slice::<QueryRange, u32>(&op.rows).as_ptr(),
            out.typed_mut::<f32>("logits")?.as_mut_ptr(),
        );
        let cfg = config(kernel_params::check_launch(
            "indexer_logits",
            kernels::indexer_logits_launch(&p),
        )?);
        // SAFETY: every pointer comes from a buffer or slice validated against the op and
        // borrowed for the whole (synchronous) launch.
        let p = unsafe { Params::new(p) };
        // SAFETY: the kernel's contract holds (see above; geometry from the kernel).
        launch(cfg, || unsafe { kernels::indexer_logits::<Emu>(p.get()) })
            .map_err(|e| emu_err("indexer_logits", e))
    }

    fn topk(&self, op: &Topk<'_>, logits: &CpuBuffer, out: &mut CpuBuffer) -> Result<()> {
        op.validate(logits.len(), out.len())?;
        if op.rows.is_empty() {
            return Ok(());
        }
        let table = match op.output {
            TopkOutput::Slots { page_table, .. } => page_table.as_slice().as_ptr(),
            TopkOutput::Positions => std::ptr::null(),
        };
        let p = kernel_params::topk(
            op,
            logits.typed::<f32>("logits")?.as_ptr(),
            bytemuck::cast_slice::<QueryRange, u32>(op.rows).as_ptr(),
            table,
            out.typed_mut::<i32>("topk")?.as_mut_ptr(),
        );
        let cfg = config(kernel_params::check_launch(
            "topk",
            kernels::topk_launch(&p),
        )?);
        // SAFETY: as in `indexer_logits`.
        let p = unsafe { Params::new(p) };
        // SAFETY: the kernel's contract holds.
        launch(cfg, || unsafe { kernels::topk::<Emu>(p.get()) }).map_err(|e| emu_err("topk", e))
    }

    fn sparse_mla(
        &self,
        op: &SparseMla,
        q: &CpuBuffer,
        cache: &CpuBuffer,
        indices: &CpuBuffer,
        out: &mut CpuBuffer,
        lse: &mut CpuBuffer,
    ) -> Result<()> {
        let pages = op.validate(q.len(), cache.len(), indices.len(), out.len(), lse.len())?;
        let idx = indices.typed::<i32>("indices")?;
        op.check_indices(idx, pages)?;
        if op.n_tokens == 0 {
            return Ok(());
        }
        let p = kernel_params::sparse_mla(
            op,
            q.typed::<u16>("q")?.as_ptr(),
            cache.bytes().as_ptr(),
            idx.as_ptr(),
            out.typed_mut::<u16>("out")?.as_mut_ptr(),
            lse.typed_mut::<f32>("lse")?.as_mut_ptr(),
        );
        let cfg = config(kernel_params::check_launch(
            "sparse_mla",
            kernels::sparse_mla_launch(&p),
        )?);
        // SAFETY: as in `indexer_logits`; indices checked above.
        let p = unsafe { Params::new(p) };
        // SAFETY: the kernel's contract holds.
        launch(cfg, || unsafe { kernels::sparse_mla::<Emu>(p.get()) })
            .map_err(|e| emu_err("sparse_mla", e))
    }

    fn copy_pages(&self, op: &CopyPages<'_>, src: &CpuBuffer, dst: &mut CpuBuffer) -> Result<()> {
        op.validate(src.len(), dst.len())?;
        if op.src_ids.is_empty() {
            return Ok(());
        }
        let p = kernel_params::copy_pages(
            op,
            src.bytes().as_ptr(),
            dst.bytes_mut().as_mut_ptr(),
            op.src_ids.as_ptr(),
            op.dst_ids.as_ptr(),
        );
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
        let p = kernel_params::page_checksums(
            op,
            pool.bytes().as_ptr(),
            op.ids.as_ptr(),
            out.typed_mut::<u64>("checksums")?.as_mut_ptr(),
        );
        // SAFETY: ids validated against the region; `out` holds one u64 per id.
        let p = unsafe { Params::new(p) };
        let cfg = config(geometry::page_checksums(op.ids.len() as u32));
        // SAFETY: the kernel's contract holds; the geometry provides the shared memory.
        launch(cfg, || unsafe { kernels::page_checksums::<Emu>(p.get()) })
            .map_err(|e| emu_err("page_checksums", e))
    }
}
