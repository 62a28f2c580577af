//! The PTX of `kernels-rs`, built by `build.rs` for sm_80, sm_90 and sm_120 and embedded in
//! the binary, with what `ptxas` and the SASS said about each kernel.

mod generated {
    include!(concat!(env!("OUT_DIR"), "/ptx_kernels.rs"));
}
pub use generated::{PTX, PTXAS_LOGS, PTX_BUILD_INFO, SASS_TENSOR_OPS};

/// The PTX to load on a device of compute capability `major.minor`: the newest built arch
/// not newer than the device (PTX for `sm_XY` JIT-compiles for any later SM).
pub fn ptx_for_device(major: u32, minor: u32) -> Option<(&'static str, &'static str)> {
    let dev = major * 10 + minor;
    PTX.iter()
        .filter_map(|&(a, p)| Some((a.strip_prefix("sm_")?.parse::<u32>().ok()?, a, p)))
        .filter(|&(n, _, _)| n <= dev)
        .max_by_key(|&(n, _, _)| n)
        .map(|(_, a, p)| (a, p))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In CI (`SPARSEKIT_REQUIRE_PTX=1`) the PTX must be there; elsewhere an empty table
    /// must say why it was skipped.
    #[test]
    fn ptx_table_is_complete() {
        let required = std::env::var("SPARSEKIT_REQUIRE_PTX").is_ok_and(|v| v == "1");
        if PTX.is_empty() {
            assert!(!required, "PTX required but missing: {PTX_BUILD_INFO}");
            assert!(PTX_BUILD_INFO.starts_with("skipped"), "{PTX_BUILD_INFO}");
            return;
        }
        let archs: Vec<&str> = PTX.iter().map(|(a, _)| *a).collect();
        assert_eq!(archs, ["sm_80", "sm_90", "sm_120"]);
        for (arch, ptx) in PTX {
            assert!(ptx.contains(&format!(".target {arch}")), "{arch}");
            for k in sparsekit_kernels::ENTRY_POINTS {
                assert!(ptx.contains(&format!(".entry {k}(")), "{arch}: {k}");
            }
        }
        if required {
            assert_eq!(PTXAS_LOGS.len(), 3, "ptxas must have assembled every arch");
        }
        assert_eq!(ptx_for_device(9, 0).map(|p| p.0), Some("sm_90"));
        assert_eq!(ptx_for_device(8, 9).map(|p| p.0), Some("sm_80"));
        assert_eq!(ptx_for_device(10, 0).map(|p| p.0), Some("sm_90"));
        assert_eq!(ptx_for_device(12, 0).map(|p| p.0), Some("sm_120"));
        assert!(ptx_for_device(7, 5).is_none());
    }
}
