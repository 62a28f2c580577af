//! A first-order performance model of the GPU kernels, built from what the emulator
//! measured ([`Profile`]: access efficiency, bytes, tensor-core instructions) and what
//! ptxas reported (registers), for the GPUs the kernels target. What `sparsekit profile`
//! prints.
//!
//! Per kernel launch and device:
//! - **occupancy**: resident blocks per SM, the smallest of the limits set by registers
//!   (allocated per warp in units of 256), shared memory (dynamic + static + the 1 KiB the
//!   driver reserves per block), threads and the block cap; and which limit binds;
//! - **waves**: `grid / (blocks per SM · SMs)`;
//! - **predicted time**: `max(bytes / bandwidth, tensor FLOPs / mma peak)`, divided by the
//!   fraction of SMs that hold a block (`min(grid, SMs) / SMs`) and multiplied by the tail
//!   of the last wave (`⌈waves⌉ / waves` when there is more than one). Bytes are the
//!   global sectors the sampled blocks touched, each counted once (perfect reuse within
//!   the sample, none across samples), scaled to the whole grid; FLOPs are 4096 per
//!   `mma.m16n8k16` and 8192 per `mma.m16n8k32`. Latency, instruction issue, L2 and the
//!   in-flight bytes an SM needs to reach full bandwidth are not modelled: the figure is a
//!   floor to compare kernels and versions with, not a measurement.
//!
//! The device figures and where they come from are in [`DEVICES`]; they are printed with
//! every report.

use serde::Serialize;
use sparsekit_kernels::emu::{GlobalOp, Profile, Space};

/// One GPU of the model.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct DeviceSpec {
    pub name: &'static str,
    /// The PTX/SASS arch whose ptxas registers apply.
    pub arch: &'static str,
    pub sms: u32,
    pub max_threads_per_sm: u32,
    pub max_blocks_per_sm: u32,
    /// 32-bit registers per SM.
    pub registers_per_sm: u32,
    /// Shared memory per SM usable by blocks, bytes.
    pub smem_per_sm: u32,
    /// Shared memory the driver reserves per resident block, bytes.
    pub smem_reserved_per_block: u32,
    /// DRAM bandwidth, bytes per second.
    pub bandwidth: f64,
    /// Dense bf16 tensor-core peak with f32 accumulation, FLOP per second.
    pub mma_bf16_flops: f64,
    /// Where the figures come from.
    pub source: &'static str,
}

/// The devices of the model: the H200 the device checks run on, and the two SM120 parts
/// the kernels are written for.
pub const DEVICES: [DeviceSpec; 3] = [
    DeviceSpec {
        name: "H200",
        arch: "sm_90",
        sms: 132,
        max_threads_per_sm: 2048,
        max_blocks_per_sm: 32,
        registers_per_sm: 65536,
        smem_per_sm: 228 * 1024,
        smem_reserved_per_block: 1024,
        bandwidth: 4.3e12,
        mma_bf16_flops: 790e12,
        source: "measured on the project's H200 (DESIGN.md: ~4.3 TB/s copy, ~790 TFLOP/s bf16 \
                 dense with PyTorch; NVIDIA's datasheet says 4.8 TB/s and 989 TFLOP/s); SM \
                 limits: CUDA C++ Programming Guide, compute capability 9.0",
    },
    // The SM120 parts (compute capability 12.0) load the `sm_120a` image first.
    DeviceSpec {
        name: "RTX 5090",
        arch: "sm_120a",
        sms: 170,
        max_threads_per_sm: 1536,
        max_blocks_per_sm: 32,
        registers_per_sm: 65536,
        smem_per_sm: 100 * 1024,
        smem_reserved_per_block: 1024,
        bandwidth: 1.792e12,
        mma_bf16_flops: 209.5e12,
        source: "NVIDIA RTX Blackwell GPU architecture whitepaper: 1792 GB/s GDDR7, 209.5 \
                 TFLOP/s dense FP16/BF16 tensor with FP32 accumulate (vendor peak, not \
                 measured); SM limits: CUDA C++ Programming Guide, compute capability 12.0",
    },
    DeviceSpec {
        name: "RTX PRO 6000 Blackwell",
        arch: "sm_120a",
        sms: 188,
        max_threads_per_sm: 1536,
        max_blocks_per_sm: 32,
        registers_per_sm: 65536,
        smem_per_sm: 100 * 1024,
        smem_reserved_per_block: 1024,
        bandwidth: 1.792e12,
        mma_bf16_flops: 503.8e12,
        source: "NVIDIA RTX PRO 6000 Blackwell datasheet: 1792 GB/s GDDR7, 503.8 TFLOP/s \
                 dense FP16/BF16 tensor with FP32 accumulate (vendor peak, not measured); SM \
                 limits: CUDA C++ Programming Guide, compute capability 12.0",
    },
];

/// What limits the resident blocks per SM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Limiter {
    Registers,
    SharedMemory,
    Threads,
    Blocks,
}

impl std::fmt::Display for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Limiter::Registers => "regs",
            Limiter::SharedMemory => "smem",
            Limiter::Threads => "threads",
            Limiter::Blocks => "blocks",
        })
    }
}

/// Resident blocks per SM of a kernel on a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Occupancy {
    pub blocks_per_sm: u32,
    pub limiter: Limiter,
    /// Resident warps per SM.
    pub warps_per_sm: u32,
}

/// Occupancy of blocks of `threads` threads using `registers` registers per thread and
/// `smem` bytes of shared memory (dynamic + static) on `dev`.
pub fn occupancy(dev: &DeviceSpec, threads: u32, registers: u32, smem: u32) -> Occupancy {
    let warps = threads.div_ceil(32).max(1);
    // Registers are allocated per warp in units of 256.
    let regs_per_warp = (registers.max(1) * 32).div_ceil(256) * 256;
    let by_regs = dev.registers_per_sm / (regs_per_warp * warps);
    let by_smem = if smem == 0 {
        u32::MAX
    } else {
        dev.smem_per_sm / (smem + dev.smem_reserved_per_block)
    };
    let by_threads = dev.max_threads_per_sm / (32 * warps);
    let limits = [
        (by_regs, Limiter::Registers),
        (by_smem, Limiter::SharedMemory),
        (by_threads, Limiter::Threads),
        (dev.max_blocks_per_sm, Limiter::Blocks),
    ];
    let (blocks, limiter) = limits
        .into_iter()
        .min_by_key(|&(n, _)| n)
        .unwrap_or((0, Limiter::Blocks));
    Occupancy {
        blocks_per_sm: blocks,
        limiter,
        warps_per_sm: blocks * warps,
    }
}

/// The whole-grid totals a profile implies (sampled counts scaled by grid / blocks run).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct GridTotals {
    /// Distinct global bytes loaded and stored (see the module docs).
    pub bytes: f64,
    /// Tensor-core FLOPs.
    pub mma_flops: f64,
}

impl GridTotals {
    /// Totals of `p` scaled to its grid.
    pub fn of(p: &Profile) -> Self {
        let scale = p.grid as f64 / p.blocks_run.max(1) as f64;
        GridTotals {
            bytes: scale * (p.unique_load_bytes + p.unique_store_bytes) as f64,
            mma_flops: scale
                * (4096.0 * p.mma_bf16 as f64 + 8192.0 * (p.mma_e4m3 + p.mma_mxf8) as f64),
        }
    }
}

/// The model's verdict for one kernel launch on one device.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Prediction {
    pub device: &'static str,
    pub occupancy: Occupancy,
    /// Blocks per wave: resident blocks per SM × SMs.
    pub blocks_per_wave: u32,
    pub waves: f64,
    /// Fraction of the SMs that hold at least one block.
    pub sm_fill: f64,
    /// `bytes / bandwidth`, µs.
    pub memory_us: f64,
    /// `FLOPs / mma peak`, µs.
    pub mma_us: f64,
    /// The predicted time, µs.
    pub time_us: f64,
    /// `memory` or `tensor`.
    pub bound: &'static str,
}

/// Predicts a launch of `grid` blocks with occupancy `occ` moving `t` on `dev`.
pub fn predict(dev: &DeviceSpec, occ: Occupancy, grid: u32, t: GridTotals) -> Prediction {
    let per_wave = occ.blocks_per_sm * dev.sms;
    let waves = if per_wave == 0 {
        f64::INFINITY
    } else {
        grid as f64 / per_wave as f64
    };
    let sm_fill = (grid.min(dev.sms) as f64 / dev.sms as f64).max(f64::MIN_POSITIVE);
    let tail = if waves > 1.0 {
        waves.ceil() / waves
    } else {
        1.0
    };
    let memory_us = t.bytes / dev.bandwidth * 1e6;
    let mma_us = t.mma_flops / dev.mma_bf16_flops * 1e6;
    let (base, bound) = if mma_us > memory_us {
        (mma_us, "tensor")
    } else {
        (memory_us, "memory")
    };
    Prediction {
        device: dev.name,
        occupancy: occ,
        blocks_per_wave: per_wave,
        waves,
        sm_fill,
        memory_us,
        mma_us,
        time_us: base / sm_fill * tail,
        bound,
    }
}

/// The access figures of a profile that the report prints.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AccessSummary {
    /// Global load efficiency (useful bytes / sector bytes), `None` without loads.
    pub load_efficiency: Option<f64>,
    pub store_efficiency: Option<f64>,
    /// Global load / store instructions by width (1, 2, 4, 8, 16 bytes).
    pub load_widths: [u64; 5],
    pub store_widths: [u64; 5],
    /// Average shared-memory bank conflict degree over all shared accesses, and the worst
    /// site's.
    pub smem_ways: Option<f64>,
    pub smem_worst_ways: Option<f64>,
    /// Active lanes per memory instruction, fraction of 32.
    pub active_lanes: Option<f64>,
    pub barriers_per_block: f64,
}

impl AccessSummary {
    pub fn of(p: &Profile) -> Self {
        let ld = p.total(Space::Global, Some(GlobalOp::Load));
        let mut st = p.total(Space::Global, Some(GlobalOp::Store));
        let at = p.total(Space::Global, Some(GlobalOp::Atomic));
        st.sectors += at.sectors;
        st.useful_bytes += at.useful_bytes;
        let sh = p.total(Space::Shared, None);
        let worst = p
            .sites
            .iter()
            .filter(|s| s.space == Some(Space::Shared))
            .filter_map(|s| s.ways())
            .fold(None, |m: Option<f64>, w| Some(m.map_or(w, |m| m.max(w))));
        AccessSummary {
            load_efficiency: ld.efficiency(),
            store_efficiency: st.efficiency(),
            load_widths: ld.widths,
            store_widths: st.widths,
            smem_ways: sh.ways(),
            smem_worst_ways: worst,
            active_lanes: p.active_lanes(),
            barriers_per_block: p.barriers_per_block(),
        }
    }
}

/// Widths used, as `16B:97% 4B:3%` (by instructions).
pub fn widths_label(w: &[u64; 5]) -> String {
    let total: u64 = w.iter().sum();
    if total == 0 {
        return "-".to_string();
    }
    let names = ["1B", "2B", "4B", "8B", "16B"];
    let mut parts: Vec<(u64, &str)> = w
        .iter()
        .zip(names)
        .filter(|(n, _)| **n > 0)
        .map(|(n, s)| (*n, s))
        .collect();
    parts.sort_by_key(|p| std::cmp::Reverse(p.0));
    parts
        .iter()
        .map(|(n, s)| format!("{s}:{:.0}%", 100.0 * *n as f64 / total as f64))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn occupancy_limits_by_hand() {
        let h200 = &DEVICES[0];
        let rtx = &DEVICES[1];
        // 256 threads at 238 registers: 238·32 = 7616 → 7680 per warp, 8 warps = 61440.
        let o = occupancy(h200, 256, 238, 64000);
        assert_eq!((o.blocks_per_sm, o.limiter), (1, Limiter::Registers));
        // 128 threads, 24 registers (21 blocks' worth), no smem: 16 blocks by threads on
        // sm_90 (2048 / 128), 12 on sm_120 (1536 / 128).
        let o = occupancy(h200, 128, 24, 0);
        assert_eq!((o.blocks_per_sm, o.limiter), (16, Limiter::Threads));
        let o = occupancy(rtx, 128, 24, 0);
        assert_eq!((o.blocks_per_sm, o.warps_per_sm), (12, 48));
        // 64 registers: 2048 per warp, 8192 per block, 8 blocks.
        let o = occupancy(h200, 128, 64, 0);
        assert_eq!((o.blocks_per_sm, o.limiter), (8, Limiter::Registers));
        // Shared memory: 40 KiB blocks, 2 per 100 KiB SM (41 KiB each with the reserve).
        let o = occupancy(rtx, 128, 32, 40 * 1024);
        assert_eq!((o.blocks_per_sm, o.limiter), (2, Limiter::SharedMemory));
        // Tiny blocks hit the block cap.
        let o = occupancy(h200, 32, 16, 0);
        assert_eq!((o.blocks_per_sm, o.limiter), (32, Limiter::Blocks));
    }

    #[test]
    fn prediction_by_hand() {
        let dev = DeviceSpec {
            sms: 100,
            bandwidth: 1e12,
            mma_bf16_flops: 1e15,
            ..DEVICES[0]
        };
        let occ = Occupancy {
            blocks_per_sm: 2,
            limiter: Limiter::Registers,
            warps_per_sm: 16,
        };
        // 1 GB at 1 TB/s = 1000 µs; 300 blocks = 1.5 waves → tail 2 / 1.5.
        let t = GridTotals {
            bytes: 1e9,
            mma_flops: 1e11,
        };
        let p = predict(&dev, occ, 300, t);
        assert_eq!(p.bound, "memory");
        assert!((p.waves - 1.5).abs() < 1e-12);
        assert!(
            (p.time_us - 1000.0 * 2.0 / 1.5).abs() < 1e-6,
            "{}",
            p.time_us
        );
        // 50 blocks fill half the SMs: twice the time.
        let p = predict(&dev, occ, 50, t);
        assert!((p.time_us - 2000.0).abs() < 1e-6);
        // Tensor-bound.
        let t = GridTotals {
            bytes: 1e6,
            mma_flops: 1e13,
        };
        let p = predict(&dev, occ, 200, t);
        assert_eq!(p.bound, "tensor");
        assert!((p.time_us - 1e4).abs() < 1e-6);
    }

    #[test]
    fn width_labels() {
        assert_eq!(widths_label(&[0, 0, 1, 0, 3]), "16B:75% 4B:25%");
        assert_eq!(widths_label(&[0; 5]), "-");
    }
}
