//! Bench cases of the memory-bound cache ops: index-K/KV stores, page copies between the
//! host and device tiers (and within the device), and page checksums. Sizes are those of
//! one DeepSeek-V3.2 layer.
//!
//! Cost model (bytes moved, no FLOPs): stores read the bf16 inputs and write the tokens'
//! cache bytes; a page copy reads and writes every page once (`2 × pages × B/page`); a
//! checksum reads every page once.

use rand::seq::SliceRandom;
use sparsekit_host::layout::PageLayout;
use sparsekit_host::ops::{CopyPages, IndexKStore, KvStore, PageChecksums, PagedRegion};
use sparsekit_host::{Backend, IndexKLayout, KvLayout, Result};

use crate::cost::Cost;
use crate::inputs::{bf16_bytes, bf16_values, rng};

/// Which tiers a copy moves between.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Host tier (`alloc_host`) → device tier (`alloc`): a cache load.
    HostToDevice,
    /// Device → host: a cache backup.
    DeviceToHost,
    /// Device → device.
    DeviceToDevice,
}

impl Direction {
    pub fn name(&self) -> &'static str {
        match self {
            Direction::HostToDevice => "h2d",
            Direction::DeviceToHost => "d2h",
            Direction::DeviceToDevice => "d2d",
        }
    }
}

/// A store of `tokens` new tokens into random slots of a pool.
#[derive(Clone, Copy, Debug)]
pub enum StoreShape {
    IndexK { layout: IndexKLayout, tokens: usize },
    Kv { layout: KvLayout, tokens: usize },
}

impl StoreShape {
    /// Bench id, e.g. `index_k_store/fp8_e4m3/t8192`.
    pub fn id(&self) -> (String, String) {
        match self {
            StoreShape::IndexK { layout, tokens } => (
                "index_k_store".into(),
                format!("{}/t{tokens}", layout.dtype().name()),
            ),
            StoreShape::Kv { layout, tokens } => (
                "kv_store".into(),
                format!("{}/t{tokens}", layout.dtype().name()),
            ),
        }
    }

    pub fn cost(&self) -> Cost {
        let (tokens, in_elems, out_bytes) = match self {
            StoreShape::IndexK { layout, tokens } => {
                (*tokens, layout.head_dim(), layout.bytes_per_token())
            }
            StoreShape::Kv { layout, tokens } => (*tokens, layout.d_qk(), layout.bytes_per_token()),
        };
        Cost {
            bytes: (tokens * (in_elems * 2 + 8 + out_bytes)) as u64,
            flops: 0,
            bf16_dot: false,
            tiles: false,
        }
    }
}

/// A ready-to-run store.
#[derive(Debug)]
pub struct StoreCase<B: Backend> {
    shape: StoreShape,
    input: B::Buffer,
    slots: Vec<i64>,
    cache: B::Buffer,
}

impl<B: Backend> StoreCase<B> {
    pub fn build(backend: &B, shape: StoreShape, seed: u64) -> Result<Self> {
        let mut r = rng(seed);
        let (tokens, dim, page_size, pool_bytes) = match shape {
            StoreShape::IndexK { layout, tokens } => (
                tokens,
                layout.head_dim(),
                layout.page_size(),
                layout.buffer_bytes(2 * tokens.div_ceil(layout.page_size())),
            ),
            StoreShape::Kv { layout, tokens } => (
                tokens,
                layout.d_qk(),
                layout.page_size(),
                layout.buffer_bytes(2 * tokens.div_ceil(layout.page_size())),
            ),
        };
        let mut slots: Vec<i64> =
            (0..(2 * tokens.div_ceil(page_size) * page_size) as i64).collect();
        slots.shuffle(&mut r);
        slots.truncate(tokens);
        Ok(StoreCase {
            shape,
            input: backend.upload(&bf16_bytes(&bf16_values(&mut r, tokens * dim, 2.0)))?,
            slots,
            cache: backend.alloc(pool_bytes)?,
        })
    }

    pub fn run(&mut self, backend: &B) -> Result<()> {
        match self.shape {
            StoreShape::IndexK { layout, .. } => backend.index_k_store(
                &IndexKStore {
                    layout,
                    slots: &self.slots,
                },
                &self.input,
                &mut self.cache,
            ),
            StoreShape::Kv { layout, .. } => backend.kv_store(
                &KvStore {
                    layout,
                    slots: &self.slots,
                },
                &self.input,
                &mut self.cache,
            ),
        }
    }
}

/// A gather/scatter of `pages` random pages between two pools of `2 × pages` pages.
#[derive(Clone, Copy, Debug)]
pub struct CopyShape {
    pub layout: PageLayout,
    pub pages: usize,
    pub direction: Direction,
}

impl CopyShape {
    pub fn id(&self) -> String {
        format!(
            "{}/{}/p{}",
            self.direction.name(),
            self.layout.info().dtype,
            self.pages
        )
    }

    pub fn cost(&self) -> Cost {
        Cost {
            bytes: 2 * (self.pages * self.layout.bytes_per_page()) as u64,
            flops: 0,
            bf16_dot: false,
            tiles: false,
        }
    }
}

/// A ready-to-run page copy.
#[derive(Debug)]
pub struct CopyCase<B: Backend> {
    shape: CopyShape,
    src: B::Buffer,
    dst: B::Buffer,
    src_ids: Vec<i32>,
    dst_ids: Vec<i32>,
}

impl<B: Backend> CopyCase<B> {
    pub fn build(backend: &B, shape: CopyShape, seed: u64) -> Result<Self> {
        let mut r = rng(seed);
        let pool = shape.pages * 2;
        let bytes = shape.layout.bytes_per_page() * pool;
        let (src, dst) = match shape.direction {
            Direction::HostToDevice => (backend.alloc_host(bytes)?, backend.alloc(bytes)?),
            Direction::DeviceToHost => (backend.alloc(bytes)?, backend.alloc_host(bytes)?),
            Direction::DeviceToDevice => (backend.alloc(bytes)?, backend.alloc(bytes)?),
        };
        let mut ids: Vec<i32> = (0..pool as i32).collect();
        ids.shuffle(&mut r);
        let src_ids = ids[..shape.pages].to_vec();
        ids.shuffle(&mut r);
        let dst_ids = ids[..shape.pages].to_vec();
        Ok(CopyCase {
            shape,
            src,
            dst,
            src_ids,
            dst_ids,
        })
    }

    pub fn run(&mut self, backend: &B) -> Result<()> {
        let region = PagedRegion::contiguous(self.shape.layout, self.shape.pages * 2);
        backend.copy_pages(
            &CopyPages {
                src: region,
                dst: region,
                src_ids: &self.src_ids,
                dst_ids: &self.dst_ids,
            },
            &self.src,
            &mut self.dst,
        )
    }
}

/// Checksums of `pages` random pages of a device pool.
#[derive(Clone, Copy, Debug)]
pub struct ChecksumShape {
    pub layout: PageLayout,
    pub pages: usize,
}

impl ChecksumShape {
    pub fn id(&self) -> String {
        format!("{}/p{}", self.layout.info().dtype, self.pages)
    }

    pub fn cost(&self) -> Cost {
        Cost {
            bytes: (self.pages * self.layout.bytes_per_page()) as u64,
            flops: 0,
            bf16_dot: false,
            tiles: false,
        }
    }
}

/// A ready-to-run checksum pass.
#[derive(Debug)]
pub struct ChecksumCase<B: Backend> {
    shape: ChecksumShape,
    pool: B::Buffer,
    ids: Vec<i32>,
    out: B::Buffer,
}

impl<B: Backend> ChecksumCase<B> {
    pub fn build(backend: &B, shape: ChecksumShape, seed: u64) -> Result<Self> {
        let mut r = rng(seed);
        let pool = 2 * shape.pages;
        let mut ids: Vec<i32> = (0..pool as i32).collect();
        ids.shuffle(&mut r);
        ids.truncate(shape.pages);
        Ok(ChecksumCase {
            shape,
            pool: backend.alloc(shape.layout.bytes_per_page() * pool)?,
            ids,
            out: backend.alloc(8 * shape.pages)?,
        })
    }

    pub fn run(&mut self, backend: &B) -> Result<()> {
        backend.page_checksums(
            &PageChecksums {
                region: PagedRegion::contiguous(self.shape.layout, 2 * self.shape.pages),
                ids: &self.ids,
            },
            &self.pool,
            &mut self.out,
        )
    }
}
