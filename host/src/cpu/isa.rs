//! The vector instruction set the CPU kernels are compiled for, chosen at run time.
//!
//! Every CPU kernel with a hot loop is compiled four times by [`isa_dispatch!`](crate::isa_dispatch): for
//! AVX-512 (F, BW) + FMA with the bf16 dot product (AVX512_BF16, `vdpbf16ps`), AVX-512
//! (F, BW) + FMA, AVX2 + FMA, and portable code. Every path performs the same correctly
//! rounded operations in the same order, so results never depend on which one runs (the
//! bf16 dot product included: see [`super::dot`] for the one caveat, f32 subnormals). The
//! path is a [`CpuIsa`]: a value that can only name a path this CPU supports, so a
//! dispatch never enters code the CPU cannot execute. A [`CpuBackend`](super::CpuBackend)
//! carries one ([`CpuBackend::with_isa`](super::CpuBackend::with_isa)); the process default
//! ([`CpuIsa::get`]) is the fastest path ([`CpuIsa::detected`]: the widest, except that
//! the bf16 dot product is used only where this core runs it faster than the f32 FMA), or
//! the one `SPARSEKIT_CPU_ISA=amx|avx512bf16|avx512|avx2|scalar` forces, so every path can
//! be tested and benchmarked on any machine that has it.
//!
//! One path is the exception to "the same bits": `amx` ([`Isa::Amx`]) runs the `avx512`
//! code with Intel AMX tiles for the indexer's score GEMM, whose accumulation no other
//! path reproduces ([`super::amx`]). It is deterministic and batch-invariant, within
//! tolerance of the others, and only ever runs when asked for by name.

use std::fmt;
use std::sync::OnceLock;

use super::peak::{bf16_dot_speedup, BF16_DOT_MIN_SPEEDUP};
use crate::error::{Error, Result};

/// The environment variable that forces a path (`amx`, `avx512bf16`, `avx512`, `avx2`,
/// `scalar`).
pub const ISA_ENV: &str = "SPARSEKIT_CPU_ISA";

/// A vector code path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// The `avx512` path's code, with Intel AMX-BF16 tiles (`tdpbf16ps`) for the indexer's
    /// score GEMM ([`super::amx`]). Its scores are deterministic and batch-invariant, within
    /// tolerance of the other paths but **not bit-identical** to them (the tile
    /// instruction's accumulation is its own), so it is never the default: forced with
    /// `SPARSEKIT_CPU_ISA=amx` or [`CpuBackend::with_isa`](super::CpuBackend::with_isa).
    /// Needs AVX-512 and a Linux kernel that grants the process AMX's tile state.
    Amx,
    /// AVX-512F, AVX-512BW, AVX-512DQ, AVX-512VL and AVX512_BF16 (`vdpbf16ps`) with FMA,
    /// POPCNT and F16C.
    Avx512Bf16,
    /// AVX-512F, AVX-512BW and AVX-512DQ with FMA, POPCNT and F16C.
    Avx512,
    /// AVX2 with FMA, POPCNT and F16C.
    Avx2,
    /// Portable code (`mul_add` via libm where the target has no FMA).
    Scalar,
}

impl Isa {
    /// Every path, widest first.
    pub const ALL: [Isa; 5] = [
        Isa::Amx,
        Isa::Avx512Bf16,
        Isa::Avx512,
        Isa::Avx2,
        Isa::Scalar,
    ];

    /// The name `SPARSEKIT_CPU_ISA` takes.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Amx => "amx",
            Isa::Avx512Bf16 => "avx512bf16",
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
            Isa::Scalar => "scalar",
        }
    }

    /// The path named `name` (as [`Isa::name`] spells it, any case).
    pub fn parse(name: &str) -> Option<Isa> {
        Isa::ALL
            .into_iter()
            .find(|i| i.name().eq_ignore_ascii_case(name.trim()))
    }

    /// Whether this CPU can run the path.
    pub fn supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Amx => Isa::Avx512.supported() && super::amx::available(),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Bf16 => {
                // VL for the 256-bit forms of `vdpbf16ps` (every AVX512_BF16 CPU has it).
                Isa::Avx512.supported()
                    && std::arch::is_x86_feature_detected!("avx512bf16")
                    && std::arch::is_x86_feature_detected!("avx512vl")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                // Every AVX-512 CPU has AVX2; checked too, as AVX-512 paths use AVX2 code
                // for 8-wide edges.
                Isa::Avx2.supported()
                    && std::arch::is_x86_feature_detected!("popcnt")
                    && std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512dq")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("popcnt")
                    && std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Amx | Isa::Avx512Bf16 | Isa::Avx512 | Isa::Avx2 => false,
        }
    }

    /// Whether the path multiplies bf16 pairs with the bf16 dot-product instruction
    /// (`vdpbf16ps`) rather than f32 FMAs (same results: [`super::dot`]).
    pub const fn bf16_dot(self) -> bool {
        matches!(self, Isa::Avx512Bf16)
    }

    /// Whether the path runs AVX-512 code (F, BW): `avx512` itself, `avx512bf16` and `amx`
    /// (the kernels that widen keys to bf16 rows use it: the bf16 routes, and the `avx512`
    /// path's keys-along attention).
    pub const fn avx512(self) -> bool {
        matches!(self, Isa::Avx512Bf16 | Isa::Amx | Isa::Avx512)
    }

    /// The vector path whose code this path runs outside its own kernels: `avx512` for
    /// `amx` (whose only code of its own is the tile GEMM), else the path itself.
    pub const fn vector(self) -> Isa {
        match self {
            Isa::Amx => Isa::Avx512,
            other => other,
        }
    }

    /// Whether the path's indexer scores are bit-identical to every other such path's
    /// (every path but `amx`: [`super::amx`]).
    pub const fn same_bits(self) -> bool {
        !matches!(self, Isa::Amx)
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A path this CPU supports: the only way to choose what [`isa_dispatch!`](crate::isa_dispatch)
/// functions run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CpuIsa(Isa);

impl CpuIsa {
    /// The portable path (every CPU runs it).
    pub const SCALAR: CpuIsa = CpuIsa(Isa::Scalar);

    /// `isa`, if this CPU supports it.
    pub fn new(isa: Isa) -> Result<CpuIsa> {
        if isa.supported() {
            Ok(CpuIsa(isa))
        } else {
            Err(Error::InvalidArgument {
                what: "cpu isa",
                detail: format!("this CPU cannot run the {isa} path"),
            })
        }
    }

    /// The widest path this CPU supports whose results are those of every other path
    /// (never `amx`: [`Isa::same_bits`]).
    pub fn widest() -> CpuIsa {
        let isa = Isa::ALL
            .into_iter()
            .find(|i| i.same_bits() && i.supported());
        CpuIsa(isa.unwrap_or(Isa::Scalar))
    }

    /// The path the CPU backend runs by default: the widest this CPU supports, except
    /// that `avx512bf16` is taken only where its bf16 dot product multiplies at least
    /// [`BF16_DOT_MIN_SPEEDUP`] times as fast as the f32 FMA on this core (measured once
    /// per process, under a millisecond: [`bf16_dot_speedup`]); elsewhere `avx512`. On
    /// cores where `vdpbf16ps` issues at half the FMA's rate (some Intel Xeons) the f32
    /// path is the faster one; both give the same results ([`super::dot`]).
    pub fn detected() -> CpuIsa {
        CpuIsa(default_path(CpuIsa::widest().isa(), bf16_dot_speedup))
    }

    /// Every path this CPU supports, widest first.
    pub fn available() -> Vec<CpuIsa> {
        Isa::ALL
            .into_iter()
            .filter_map(|i| CpuIsa::new(i).ok())
            .collect()
    }

    /// The path `value` (of [`ISA_ENV`]) names, or the detected one when unset or empty.
    /// An unknown name or a path this CPU lacks is an error.
    pub fn from_env_value(value: Option<&str>) -> Result<CpuIsa> {
        match value.map(str::trim).filter(|v| !v.is_empty()) {
            None => Ok(CpuIsa::detected()),
            Some(v) => match Isa::parse(v) {
                Some(isa) => CpuIsa::new(isa).map_err(|_| Error::InvalidArgument {
                    what: ISA_ENV,
                    detail: format!("{v}: this CPU cannot run that path"),
                }),
                None => Err(Error::InvalidArgument {
                    what: ISA_ENV,
                    detail: format!("{v:?} is not one of amx, avx512bf16, avx512, avx2, scalar"),
                }),
            },
        }
    }

    /// [`CpuIsa::from_env_value`] of the environment.
    pub fn from_env() -> Result<CpuIsa> {
        CpuIsa::from_env_value(std::env::var(ISA_ENV).ok().as_deref())
    }

    /// The process default, decided once: [`CpuIsa::from_env`], or when that fails the
    /// detected path (with one warning on stderr naming the problem).
    pub fn get() -> CpuIsa {
        static DEFAULT: OnceLock<CpuIsa> = OnceLock::new();
        *DEFAULT.get_or_init(|| {
            CpuIsa::from_env().unwrap_or_else(|e| {
                let d = CpuIsa::detected();
                eprintln!("sparsekit: {e}; using the {} path", d.isa());
                d
            })
        })
    }

    /// The path.
    pub const fn isa(self) -> Isa {
        self.0
    }

    /// The vector path whose code runs outside the path's own kernels ([`Isa::vector`]).
    pub const fn vector(self) -> Isa {
        self.0.vector()
    }

    /// `isa` without checking the CPU (for [`isa_dispatch!`], inside a path that is only
    /// entered through a checked `CpuIsa` of it).
    ///
    /// # Safety
    /// This CPU supports `isa`.
    #[doc(hidden)]
    pub const unsafe fn assume_supported(isa: Isa) -> CpuIsa {
        CpuIsa(isa)
    }
}

/// The default path given the widest one and the bf16 dot product's measured speed-up
/// over the f32 FMA (asked for only when the widest path has the instruction).
fn default_path(widest: Isa, speedup: impl FnOnce() -> Option<f64>) -> Isa {
    match widest {
        Isa::Avx512Bf16 if speedup().is_none_or(|s| s < BF16_DOT_MIN_SPEEDUP) => Isa::Avx512,
        other => other,
    }
}

/// Declares a function compiled for every [`Isa`] and dispatched on a [`CpuIsa`]:
///
/// ```ignore
/// isa_dispatch! {
///     /// Docs.
///     pub fn name(a: &[f32], b: &mut [f32]) -> f32 = |ISA| body(a, b);
/// }
/// ```
///
/// defines `pub fn name(isa: CpuIsa, a: &[f32], b: &mut [f32]) -> f32`, which runs `body`
/// compiled with `#[target_feature]` for AVX-512 with AVX512_BF16, AVX-512 or AVX2 (each
/// with FMA), or as portable code. Inside the body, the constant `ISA` (the name given between the bars) is the
/// [`CpuIsa`] being compiled, for choices such as register-tile widths and for calls of
/// other dispatched functions. The body should call `#[inline(always)]` code so that it is
/// compiled for the path.
#[macro_export]
macro_rules! isa_dispatch {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?
        = |$isa:ident| $body:expr;) => {
        $(#[$meta])*
        #[inline]
        $vis fn $name(isa: $crate::cpu::isa::CpuIsa, $($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512bw,avx512bf16,fma,popcnt")]
            unsafe fn avx512bf16($($arg: $ty),*) $(-> $ret)? {
                #[allow(dead_code)]
                const $isa: $crate::cpu::isa::CpuIsa =
                    // SAFETY: this function runs only when a `CpuIsa` of this path was given.
                    unsafe { $crate::cpu::isa::CpuIsa::assume_supported($crate::cpu::isa::Isa::Avx512Bf16) };
                $body
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512bw,fma,popcnt")]
            unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                #[allow(dead_code)]
                const $isa: $crate::cpu::isa::CpuIsa =
                    // SAFETY: this function runs only when a `CpuIsa` of this path was given.
                    unsafe { $crate::cpu::isa::CpuIsa::assume_supported($crate::cpu::isa::Isa::Avx512) };
                $body
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma,popcnt")]
            unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                #[allow(dead_code)]
                const $isa: $crate::cpu::isa::CpuIsa =
                    // SAFETY: this function runs only when a `CpuIsa` of this path was given.
                    unsafe { $crate::cpu::isa::CpuIsa::assume_supported($crate::cpu::isa::Isa::Avx2) };
                $body
            }
            #[inline(always)]
            fn scalar($($arg: $ty),*) $(-> $ret)? {
                #[allow(dead_code)]
                const $isa: $crate::cpu::isa::CpuIsa = $crate::cpu::isa::CpuIsa::SCALAR;
                $body
            }
            match isa.isa() {
                // SAFETY: a `CpuIsa` names only a path this CPU supports (checked when it
                // was made): AVX-512F, AVX-512BW, AVX512_BF16, FMA and POPCNT here.
                #[cfg(target_arch = "x86_64")]
                $crate::cpu::isa::Isa::Avx512Bf16 => unsafe { avx512bf16($($arg),*) },
                // SAFETY: as above: AVX-512F, AVX-512BW, FMA and POPCNT (`amx` runs the
                // `avx512` code outside its tile kernels, and requires its features).
                #[cfg(target_arch = "x86_64")]
                $crate::cpu::isa::Isa::Avx512 | $crate::cpu::isa::Isa::Amx => unsafe { avx512($($arg),*) },
                // SAFETY: as above: AVX2, FMA and POPCNT.
                #[cfg(target_arch = "x86_64")]
                $crate::cpu::isa::Isa::Avx2 => unsafe { avx2($($arg),*) },
                _ => scalar($($arg),*),
            }
        }
    };
}

/// Asks the CPU to bring `bytes` into its caches (L2 and closer) ahead of use: a hint
/// for gathers of scattered cache rows. It changes no result and never faults.
#[inline(always)]
pub fn prefetch(bytes: &[u8]) {
    prefetch_lines::<false>(bytes.as_ptr(), bytes.len());
}

/// Most lines of a run that [`prefetch_lines`] asks for at fixed offsets from its first
/// line; a longer run goes line by line with the next line's address worked out in
/// between. Short runs (a key row of the attention, a 16-token page of the tiny model's
/// index keys) are then a few instructions each: AMD Zen 4, two threads, the tiny decode
/// (`fp8_e4m3/b32_ctx2048_h8_d64_n1`) 340.7 → 323.2 µs, serving attention `t32` 148.8 →
/// 142.9 µs. Long runs from memory (the 64-head indexer's chunks of 32 lines) measured
/// faster asked for at the slower pace: 22.8 ms against 24.3 with every run at fixed
/// offsets.
const SHORT_RUN_LINES: usize = 16;

/// One prefetch per 64-byte line that the `len` bytes from `start` touch, the line holding
/// the last byte included (steps of 64 bytes from an unaligned start would leave it out);
/// into L1 when `L1`, else L2 and closer. An address rather than a slice, for callers that
/// may not form a reference to the bytes (a cache other threads are writing). It reads
/// nothing the program can observe and never faults, whatever the address.
#[inline(always)]
pub(crate) fn prefetch_lines<const L1: bool>(start: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    each_line(start, len, |p| {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
        // SAFETY: a prefetch is a hint: it reads nothing the program can observe and never
        // faults, at any address; SSE is part of the x86_64 baseline. (`unsafe` only for
        // toolchains where the intrinsic is still unsafe.)
        #[allow(unused_unsafe)]
        unsafe {
            if L1 {
                _mm_prefetch::<_MM_HINT_T0>(p.cast())
            } else {
                _mm_prefetch::<_MM_HINT_T1>(p.cast())
            }
        }
    });
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (start, len);
}

/// Calls `f` once with an address inside each 64-byte line that the `len` bytes from
/// `start` touch, in order: a short run ([`SHORT_RUN_LINES`]) with each line's start, at
/// fixed steps from the first; a longer one with `start`, then each next line's start.
/// The pointers only move `wrapping`: they are never dereferenced.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[inline(always)]
fn each_line(start: *const u8, len: usize, mut f: impl FnMut(*const u8)) {
    if len == 0 {
        return;
    }
    let skip = start as usize % 64;
    let lines = (skip + len).div_ceil(64);
    if lines <= SHORT_RUN_LINES {
        let first = start.wrapping_sub(skip);
        for l in 0..lines {
            f(first.wrapping_add(64 * l));
        }
        return;
    }
    let mut off = 0;
    while off < len {
        let p = start.wrapping_add(off);
        f(p);
        // The next line's first byte.
        off += 64 - (p as usize % 64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Every line the bytes touch is asked for exactly once, in order, and no other: short
    /// and long runs, every start within a line, runs ending on a line's last byte or
    /// first, and nothing for no bytes.
    #[test]
    fn each_line_visits_exactly_the_touched_lines() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        let base = 64 * rng.gen_range(1usize..1 << 20);
        let mut cases: Vec<(usize, usize)> = vec![(0, 0), (63, 0), (0, 1), (63, 1), (63, 2)];
        for lines in [
            1,
            2,
            SHORT_RUN_LINES - 1,
            SHORT_RUN_LINES,
            SHORT_RUN_LINES + 1,
            40,
        ] {
            for skip in [0, 1, 32, 63] {
                let end = 64 * lines - skip;
                cases.extend([(skip, end), (skip, end - 1), (skip, end + 1)]);
            }
        }
        cases.extend((0..200).map(|_| (rng.gen_range(0..64), rng.gen_range(0..3000))));
        for (skip, len) in cases {
            let start = base + skip;
            let mut got = Vec::new();
            each_line(start as *const u8, len, |p| got.push(p as usize / 64));
            let want: Vec<usize> = if len == 0 {
                vec![]
            } else {
                (start / 64..=(start + len - 1) / 64).collect()
            };
            assert_eq!(got, want, "start {start:#x} len {len}");
        }
    }

    #[test]
    fn env_values_select_supported_paths_and_reject_the_rest() {
        assert_eq!(CpuIsa::from_env_value(None).unwrap(), CpuIsa::detected());
        assert_eq!(
            CpuIsa::from_env_value(Some(" ")).unwrap(),
            CpuIsa::detected()
        );
        assert_eq!(
            CpuIsa::from_env_value(Some("SCALAR")).unwrap().isa(),
            Isa::Scalar
        );
        for isa in Isa::ALL {
            let got = CpuIsa::from_env_value(Some(isa.name()));
            assert_eq!(got.is_ok(), isa.supported(), "{isa}");
            if let Ok(c) = got {
                assert_eq!(c.isa(), isa);
            }
        }
        assert!(matches!(
            CpuIsa::from_env_value(Some("sse9")),
            Err(Error::InvalidArgument { what: ISA_ENV, .. })
        ));
        let avail = CpuIsa::available();
        // The widest path with the shared bits comes first, after `amx` where it runs.
        let shared: Vec<CpuIsa> = avail
            .iter()
            .copied()
            .filter(|i| i.isa().same_bits())
            .collect();
        assert_eq!(shared[0], CpuIsa::widest());
        assert_eq!(avail[0].isa() == Isa::Amx, Isa::Amx.supported());
        assert!(avail.contains(&CpuIsa::detected()));
        assert_eq!(avail.last().map(|c| c.isa()), Some(Isa::Scalar));
    }

    #[test]
    fn the_default_takes_the_bf16_dot_product_only_where_it_pays() {
        let pick = |widest, s: Option<f64>| default_path(widest, || s);
        assert_eq!(pick(Isa::Avx512Bf16, Some(2.0)), Isa::Avx512Bf16);
        assert_eq!(
            pick(Isa::Avx512Bf16, Some(BF16_DOT_MIN_SPEEDUP)),
            Isa::Avx512Bf16
        );
        assert_eq!(pick(Isa::Avx512Bf16, Some(1.0)), Isa::Avx512);
        assert_eq!(pick(Isa::Avx512Bf16, Some(0.5)), Isa::Avx512);
        assert_eq!(pick(Isa::Avx512Bf16, None), Isa::Avx512);
        for other in [Isa::Avx512, Isa::Avx2, Isa::Scalar] {
            // Never measured, never changed.
            assert_eq!(default_path(other, || unreachable!()), other);
        }
        // This machine: the rule applied to its own measurement.
        let want = default_path(CpuIsa::widest().isa(), bf16_dot_speedup);
        assert_eq!(CpuIsa::detected().isa(), want);
    }

    isa_dispatch! {
        /// A sum whose path is reported with it.
        fn path_sum(xs: &[f32]) -> (Isa, f32) =
            |ISA| (ISA.isa(), xs.iter().fold(0.0, |a, &x| x.mul_add(2.0, a)));
    }

    #[test]
    fn dispatch_runs_the_path_asked_for_with_identical_results() {
        let xs: Vec<f32> = (0..1000).map(|i| (i as f32).sin()).collect();
        let want = path_sum(CpuIsa::new(Isa::Scalar).unwrap(), &xs);
        assert_eq!(want.0, Isa::Scalar);
        for isa in CpuIsa::available() {
            let got = path_sum(isa, &xs);
            // `amx` runs the `avx512` code outside its tile kernels.
            assert_eq!(got.0, isa.vector());
            assert_eq!(got.1.to_bits(), want.1.to_bits(), "{:?}", isa.isa());
        }
    }
}
