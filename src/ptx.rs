//! The PTX of `kernels-rs`, built by `build.rs` for sm_80, sm_90, sm_120 and sm_120a and embedded in
//! the binary, with the cubins ptxas assembled from it, what `ptxas` and the SASS said about
//! each kernel, and the warp-wide instructions of each function (the build checked them).

mod generated {
    include!(concat!(env!("OUT_DIR"), "/ptx_kernels.rs"));
}
pub use generated::{CUBINS, PTX, PTXAS_LOGS, PTX_BUILD_INFO, SASS_TENSOR_OPS, WARP_OPS};

/// The PTX to load on a device of compute capability `major.minor`: the newest built arch
/// not newer than the device (PTX for `sm_XY` JIT-compiles for any later SM). The
/// arch-specific `sm_XYa` builds are never chosen here (they run on `X.Y` only; the CUDA
/// loader tries them first on such a device).
pub fn ptx_for_device(major: u32, minor: u32) -> Option<(&'static str, &'static str)> {
    let dev = major * 10 + minor;
    PTX.iter()
        .filter_map(|&(a, p)| Some((a.strip_prefix("sm_")?.parse::<u32>().ok()?, a, p)))
        .filter(|&(n, _, _)| n <= dev)
        .max_by_key(|&(n, _, _)| n)
        .map(|(_, a, p)| (a, p))
}

/// `(major, minor)` of an `sm_XY` arch name (`sm_120` → (12, 0)); `None` for the
/// arch-specific `sm_XYa`.
fn arch_cc(arch: &str) -> Option<(u32, u32)> {
    let n: u32 = arch.strip_prefix("sm_")?.parse().ok()?;
    Some((n / 10, n % 10))
}

/// The cubin to load on a device of compute capability `major.minor`: SASS runs on devices
/// of its major version with an equal or higher minor, so the newest embedded cubin of the
/// device's major whose minor is not above the device's.
pub fn cubin_for_device(major: u32, minor: u32) -> Option<(&'static str, &'static [u8])> {
    cubin_in(CUBINS, major, minor)
}

fn cubin_in(
    cubins: &[(&'static str, &'static [u8])],
    major: u32,
    minor: u32,
) -> Option<(&'static str, &'static [u8])> {
    cubins
        .iter()
        .filter_map(|&(a, c)| Some((arch_cc(a)?, a, c)))
        .filter(|&((ma, mi), _, _)| ma == major && mi <= minor)
        .max_by_key(|&((_, mi), _, _)| mi)
        .map(|(_, a, c)| (a, c))
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
        assert_eq!(archs, ["sm_80", "sm_90", "sm_120", "sm_120a"]);
        for (arch, ptx) in PTX {
            assert!(ptx.contains(&format!(".target {arch}")), "{arch}");
            for k in sparsekit_kernels::ENTRY_POINTS {
                assert!(ptx.contains(&format!(".entry {k}(")), "{arch}: {k}");
            }
        }
        if required {
            assert_eq!(PTXAS_LOGS.len(), 4, "ptxas must have assembled every arch");
        }
        assert_eq!(ptx_for_device(9, 0).map(|p| p.0), Some("sm_90"));
        assert_eq!(ptx_for_device(8, 9).map(|p| p.0), Some("sm_80"));
        assert_eq!(ptx_for_device(10, 0).map(|p| p.0), Some("sm_90"));
        assert_eq!(ptx_for_device(12, 0).map(|p| p.0), Some("sm_120"));
        assert_eq!(ptx_for_device(12, 1).map(|p| p.0), Some("sm_120"));
        // Only the sm_120a PTX carries the block-scaled MXFP8 mma, in sparse_mla_v4.
        for (arch, ptx) in PTX {
            let has = ptx.contains("kind::mxf8f6f4.block_scale");
            assert_eq!(has, *arch == "sm_120a", "{arch}");
        }
        assert!(ptx_for_device(7, 5).is_none());
        if required {
            let cubin_archs: Vec<&str> = CUBINS.iter().map(|(a, _)| *a).collect();
            assert_eq!(cubin_archs, ["sm_80", "sm_90", "sm_120", "sm_120a"]);
            for (_, c) in CUBINS {
                assert_eq!(&c[..4], b"\x7fELF", "a cubin is an ELF image");
            }
            assert_eq!(WARP_OPS.len(), 4);
        }
    }

    #[test]
    fn cubins_match_the_exact_major() {
        const FAKE: &[(&str, &[u8])] = &[("sm_80", b"a"), ("sm_90", b"b"), ("sm_120", b"c")];
        let pick = |ma, mi| cubin_in(FAKE, ma, mi).map(|x| x.0);
        assert_eq!(pick(9, 0), Some("sm_90"));
        assert_eq!(pick(8, 9), Some("sm_80"), "sm_80 SASS runs on 8.x");
        assert_eq!(pick(12, 0), Some("sm_120"));
        assert_eq!(pick(12, 1), Some("sm_120"));
        assert_eq!(
            pick(10, 0),
            None,
            "no SASS for 10.x: the PTX is JIT-compiled"
        );
        assert_eq!(pick(7, 5), None);
    }

    /// Every arch's PTX declares the lowest `.version` the arch needs (older drivers accept
    /// it), and dynamic shared memory is 16-byte aligned (the kernels issue 16-byte shared
    /// accesses).
    #[test]
    fn ptx_versions_and_shared_alignment() {
        for (arch, ptx) in PTX {
            let want = match *arch {
                "sm_80" => ".version 7.0",
                "sm_90" => ".version 7.8",
                _ => ".version 8.7",
            };
            assert!(ptx.contains(want), "{arch}: want {want}");
            assert!(
                ptx.contains(".extern .shared .align 16 .b8 gpu_launch_sized_workgroup_mem[]"),
                "{arch}: dynamic shared memory must be 16-byte aligned"
            );
        }
    }

    /// The warp-wide instruction counts the build checked are embedded for every kernel.
    #[test]
    fn warp_ops_cover_every_kernel() {
        for (arch, tsv) in WARP_OPS {
            let ops = crate::ptxas::warp_ops_from_tsv(tsv);
            for k in sparsekit_kernels::ENTRY_POINTS {
                assert!(ops.iter().any(|o| o.name == *k), "{arch}: {k}");
            }
            let mla = ops.iter().find(|o| o.name == "sparse_mla");
            assert!(
                mla.is_some_and(|o| o.ops.mma > 0 && o.ops.bar > 0),
                "{arch}"
            );
        }
    }
}
