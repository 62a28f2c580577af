//! Per-kernel resource usage at each arch, parsed from the embedded `ptxas -v` logs and
//! SASS summaries, with the warp-wide instructions the build checked (what `sparsekit
//! kernels` prints).

use serde::Serialize;

use crate::ptx::{PTX, PTXAS_LOGS, SASS_TENSOR_OPS, WARP_OPS};
use crate::ptxas::{parse_ptxas_log, sass_from_tsv, warp_ops_from_tsv};

/// One kernel at one arch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KernelResources {
    pub kernel: String,
    pub arch: String,
    pub registers: u32,
    /// Spill stores + spill loads, bytes.
    pub spill_bytes: u32,
    /// Static shared memory, bytes (dynamic shared memory is set per launch).
    pub shared_bytes: u32,
    /// Stack frame, bytes.
    pub stack_bytes: u32,
    pub barriers: u32,
    /// Whether the SASS holds HMMA/QMMA instructions; `None` when no SASS was available.
    pub tensor_core: Option<bool>,
    /// The SASS's tensor-core instructions: HMMA (bf16 `mma.sync`) and QMMA (fp8, and on
    /// sm_120a the block-scaled `QMMA.SF` of the MXFP8 path), static counts; `None` when no
    /// SASS was available.
    pub sass_mma: Option<SassMma>,
    /// Warp-wide instructions of the kernel's PTX (`mma.sync`, `shfl.sync`, `vote.sync`,
    /// barriers), all convergent in the IR they came from (checked by the build).
    pub warp_ops: Option<WarpOpsCounts>,
}

/// Static tensor-core instruction counts of a kernel's SASS.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SassMma {
    pub hmma: u32,
    pub qmma: u32,
}

/// [`crate::ptxas::WarpOps`] for the report.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct WarpOpsCounts {
    pub mma: u32,
    pub shfl: u32,
    pub vote: u32,
    pub bar: u32,
}

/// The kernels (entry functions) of one `ptxas -v` log (tensor_core unset).
pub fn kernels_of_log(arch: &str, log: &str) -> Vec<KernelResources> {
    parse_ptxas_log(log)
        .into_iter()
        .filter(|f| f.entry)
        .map(|f| KernelResources {
            spill_bytes: f.spill_bytes(),
            kernel: f.name,
            arch: arch.to_string(),
            registers: f.registers,
            shared_bytes: f.shared_bytes,
            stack_bytes: f.stack_bytes,
            barriers: f.barriers,
            tensor_core: None,
            sass_mma: None,
            warp_ops: None,
        })
        .collect()
}

/// Every kernel × arch that ptxas assembled into this binary.
pub fn report() -> Vec<KernelResources> {
    let mut all = Vec::new();
    for (arch, log) in PTXAS_LOGS {
        let sass: Vec<(String, u32, u32)> = SASS_TENSOR_OPS
            .iter()
            .filter(|(a, _)| a == arch)
            .flat_map(|(_, s)| sass_from_tsv(s))
            .collect();
        let warp: Vec<_> = WARP_OPS
            .iter()
            .filter(|(a, _)| a == arch)
            .flat_map(|(_, t)| warp_ops_from_tsv(t))
            .collect();
        for mut k in kernels_of_log(arch, log) {
            if !sass.is_empty() {
                let (hmma, qmma) = sass
                    .iter()
                    .find(|(n, _, _)| *n == k.kernel)
                    .map_or((0, 0), |&(_, h, q)| (h, q));
                k.tensor_core = Some(hmma + qmma > 0);
                k.sass_mma = Some(SassMma { hmma, qmma });
            }
            k.warp_ops = warp
                .iter()
                .find(|w| w.name == k.kernel)
                .map(|w| WarpOpsCounts {
                    mma: w.ops.mma,
                    shfl: w.ops.shfl,
                    vote: w.ops.vote,
                    bar: w.ops.bar,
                });
            all.push(k);
        }
    }
    all
}

/// Archs with embedded PTX.
pub fn archs() -> Vec<&'static str> {
    PTX.iter().map(|(a, _)| *a).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_entries_are_kernels() {
        let log = "ptxas info    : Function properties for helper\n    96 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\nptxas info    : Compiling entry function 'copy_pages' for 'sm_90'\nptxas info    : Function properties for copy_pages\n    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\nptxas info    : Used 22 registers, used 1 barriers, 64 bytes smem\n";
        let r = kernels_of_log("sm_90", log);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].kernel, "copy_pages");
        assert_eq!((r[0].stack_bytes, r[0].spill_bytes), (8, 8));
        assert_eq!(
            (r[0].registers, r[0].shared_bytes, r[0].barriers),
            (22, 64, 1)
        );
    }

    /// Every kernel of every embedded arch is in the report, with its SASS summary when
    /// cuobjdump ran.
    #[test]
    fn the_report_covers_every_entry_point() {
        let r = report();
        for (arch, _) in PTXAS_LOGS {
            for k in sparsekit_kernels::ENTRY_POINTS {
                assert!(
                    r.iter().any(|x| x.arch == *arch && x.kernel == *k),
                    "{arch}: {k} missing"
                );
            }
        }
    }
}
