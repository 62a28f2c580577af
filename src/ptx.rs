//! The PTX of `kernels-rs`, built by `build.rs` for sm_80, sm_90 and sm_120 and embedded in
//! the binary, with what `ptxas` and the SASS said about each kernel.

mod generated {
    include!(concat!(env!("OUT_DIR"), "/ptx_kernels.rs"));
}
pub use generated::{PTX, PTXAS_LOGS, PTX_BUILD_INFO, SASS_TENSOR_OPS};

/// PTX built for exactly `arch` (`"sm_80"`, `"sm_90"`, `"sm_120"`).
pub fn ptx_for(arch: &str) -> Option<&'static str> {
    PTX.iter().find(|(a, _)| *a == arch).map(|(_, p)| *p)
}

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
