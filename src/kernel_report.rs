//! Per-kernel resource usage at each arch, parsed from the embedded `ptxas -v` logs and
//! SASS summaries (what `sparsekit kernels` prints).

use serde::Serialize;

use crate::ptx::{PTX, PTXAS_LOGS, SASS_TENSOR_OPS};

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
}

/// Parses one `ptxas -v` log into per-kernel records (tensor_core unset).
pub fn parse_ptxas_log(arch: &str, log: &str) -> Vec<KernelResources> {
    let mut out: Vec<KernelResources> = Vec::new();
    let num_before = |s: &str, unit: &str| -> u32 {
        s.split(',')
            .find(|p| p.contains(unit))
            .and_then(|p| p.split_whitespace().find_map(|w| w.parse::<u32>().ok()))
            .unwrap_or(0)
    };
    // Properties of a non-entry function (not fully inlined) must not overwrite the entry's.
    let mut props_of_entry = false;
    for line in log.lines() {
        if let Some(rest) = line.split("Function properties for ").nth(1) {
            props_of_entry = out.last().is_some_and(|k| k.kernel == rest.trim());
        } else if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or("").to_string();
            out.push(KernelResources {
                kernel: name,
                arch: arch.to_string(),
                registers: 0,
                spill_bytes: 0,
                shared_bytes: 0,
                stack_bytes: 0,
                barriers: 0,
                tensor_core: None,
            });
        } else if let Some(k) = out.last_mut() {
            if line.contains("bytes stack frame") && props_of_entry {
                k.stack_bytes = num_before(line, "stack frame");
                k.spill_bytes = num_before(line, "spill stores") + num_before(line, "spill loads");
            } else if let Some(used) = line.split("Used ").nth(1) {
                k.registers = num_before(used, "registers");
                k.barriers = num_before(used, "barrier");
                k.shared_bytes = num_before(used, "smem");
            }
        }
    }
    out
}

/// Every kernel × arch that ptxas assembled into this binary.
pub fn report() -> Vec<KernelResources> {
    let mut all = Vec::new();
    for (arch, log) in PTXAS_LOGS {
        let sass: Vec<(&str, u32, u32)> = SASS_TENSOR_OPS
            .iter()
            .filter(|(a, _)| a == arch)
            .flat_map(|(_, s)| s.lines())
            .filter_map(|l| {
                let mut it = l.split('\t');
                Some((
                    it.next()?,
                    it.next()?.parse().ok()?,
                    it.next()?.parse().ok()?,
                ))
            })
            .collect();
        for mut k in parse_ptxas_log(arch, log) {
            if !sass.is_empty() {
                k.tensor_core = Some(sass.iter().any(|&(n, h, q)| n == k.kernel && h + q > 0));
            }
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
    fn parses_a_ptxas_log() {
        let log = "ptxas info    : 0 bytes gmem\n\
ptxas info    : Compiling entry function 'copy_pages' for 'sm_90'\n\
ptxas info    : Function properties for copy_pages\n\
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n\
ptxas info    : Function properties for helper_not_inlined\n\
    96 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 22 registers, used 1 barriers, 64 bytes smem, 400 bytes cmem[0]\n";
        let r = parse_ptxas_log("sm_90", log);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].kernel, "copy_pages");
        assert_eq!(r[0].registers, 22);
        assert_eq!(r[0].spill_bytes, 8);
        assert_eq!(r[0].stack_bytes, 8);
        assert_eq!(r[0].shared_bytes, 64);
        assert_eq!(r[0].barriers, 1);
    }
}
