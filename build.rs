//! Builds the nvptx64 kernels of `kernels-rs/` into PTX (one file per SM arch)
//! and embeds them into the `sparsekit` lib as `PTX: &[(&str, &str)]`.
//!
//! Pipeline (per arch):
//!   nightly cargo rustc --target nvptx64-nvidia-cuda -Zbuild-std=core
//!       -- -Ctarget-cpu=sm_XX -Ccodegen-units=1 -Cno-prepopulate-passes
//!          --emit=llvm-bc=...   (own target dir; the IR is not optimised yet)
//!   llvm-link kernel.bc --only-needed sys.bc   (sys.bc = core + compiler_builtins bitcode)
//!   llvm-dis | mark every warp-wide inline asm call `convergent` | llvm-as
//!   opt -passes=internalize,globaldce,default<O3> -internalize-public-api-list=<exports>
//!   llc -march=nvptx64 -mcpu=sm_XX -mattr=+ptxNN -O3  ->  OUT_DIR/sparsekit_kernels.sm_XX.ptx
//!   check: per function, the warp-wide instructions of the PTX (mma/shfl/vote/bar) are
//!          exactly the convergent calls of the optimised IR
//!   ptxas -arch=sm_XX -v -o sparsekit_kernels.sm_XX.cubin (only if ptxas is found; errors
//!          and spills above sm_80 fail the build); the cubins are embedded too
//!
//! Why the IR is optimised here and not by rustc: LLVM may move or duplicate a call into
//! lane-divergent control flow unless the call is `convergent`, and Rust cannot mark an
//! `asm!` block convergent. `mma.sync` has no convergent NVVM intrinsic, so the script
//! marks its asm calls in the unoptimised IR, and every LLVM pass then honours it.
//!
//! Env knobs: SPARSEKIT_REQUIRE_PTX=1 (missing toolchain is an error),
//! SPARSEKIT_SKIP_PTX=1 (never build PTX), SPARSEKIT_NIGHTLY (toolchain name,
//! default "nightly"), SPARSEKIT_PTX_TARGET_DIR (inner target dir, default
//! OUT_DIR/ptx-target), SPARSEKIT_PTX_CACHE (a directory where the built files are kept
//! under a key of everything they are made from, so that another build of the same
//! sources — `cargo clippy`, a second target dir — copies them instead of rebuilding;
//! unset: no cache), PTXAS (path to ptxas), SPARSEKIT_PTXAS_VERBOSE=1 (ptxas -v summary
//! as cargo warnings, on a fresh build only).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a build script fails by panicking

use std::env;
use std::ffi::OsString;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

// The ptxas / SASS parser of the library (`sparsekit::ptxas`), so the build's spill gate and
// `sparsekit kernels` read the logs the same way; the build uses part of it.
#[allow(dead_code)]
#[path = "src/ptxas.rs"]
mod ptxas;

/// (arch, lowest PTX ISA version the arch needs, as an llc feature): sm_80 -> 7.0, sm_90 ->
/// 7.8, sm_120 and sm_120a -> 8.7, so that drivers as old as the arch accept the module.
/// LLVM cannot see inline asm: a kernel using the e4m3 `mma.sync ... m16n8k32` needs PTX
/// 8.4, and the build raises the version for an arch whose PTX contains it
/// ([`E4M3_PTX`]). `sm_120a` is the arch-specific target of compute capability 12.0 (RTX
/// 50 series, RTX PRO Blackwell): its PTX also carries the block-scaled MXFP8 mma
/// (`kind::mxf8f6f4`), which plain `sm_120` rejects, and loads only on 12.0 devices.
const ARCHS: &[(&str, &str)] = &[
    ("sm_80", "ptx70"),
    ("sm_90", "ptx78"),
    ("sm_120", "ptx87"),
    ("sm_120a", "ptx87"),
];

/// PTX ISA version the e4m3 `mma.sync` needs.
const E4M3_PTX: &str = "ptx84";

/// Mnemonics of the instructions all (named) lanes of a warp must execute together: an
/// inline asm call containing one is marked `convergent`.
const WARP_WIDE_ASM: &[&str] = &[
    "mma.sync",
    "shfl.sync",
    "vote.sync",
    "bar.sync",
    "barrier.sync",
    "bar.warp.sync",
    "ldmatrix",
    "match.sync",
    "redux.sync",
];

const NVPTX: &str = "nvptx64-nvidia-cuda";
const KERNEL_CRATE: &str = "sparsekit_kernels";

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").unwrap());
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").unwrap());
    let kernels_dir = manifest_dir.join("kernels-rs");

    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=kernels-rs/src");
    println!("cargo:rerun-if-changed=kernels-rs/Cargo.toml");
    for v in [
        "SPARSEKIT_REQUIRE_PTX",
        "SPARSEKIT_SKIP_PTX",
        "SPARSEKIT_NIGHTLY",
        "SPARSEKIT_PTX_TARGET_DIR",
        "SPARSEKIT_PTX_CACHE",
        "SPARSEKIT_PTXAS_VERBOSE",
        "PTXAS",
    ] {
        println!("cargo:rerun-if-env-changed={v}");
    }

    let require = env_flag("SPARSEKIT_REQUIRE_PTX");
    let result = if env_flag("SPARSEKIT_SKIP_PTX") && !require {
        Err(Skip("SPARSEKIT_SKIP_PTX=1".into()))
    } else {
        build_all(&manifest_dir, &kernels_dir, &out_dir)
    };

    let (entries, info) = match result {
        Ok(entries) => (entries, "built".to_string()),
        Err(Skip(msg)) => {
            if require {
                panic!("SPARSEKIT_REQUIRE_PTX=1 but the PTX kernels cannot be built: {msg}");
            }
            if !env_flag("SPARSEKIT_SKIP_PTX") {
                println!(
                    "cargo:warning=sparsekit: building WITHOUT GPU kernels (PTX list is empty): {msg}"
                );
            }
            (Vec::new(), format!("skipped: {msg}"))
        }
    };
    write_generated(&out_dir, &entries, &info);
}

/// A reason to build without PTX (soft failure). Hard failures `panic!`.
struct Skip(String);

fn env_flag(name: &str) -> bool {
    matches!(env::var(name).as_deref(), Ok("1") | Ok("true") | Ok("yes"))
}

struct Nightly {
    sysroot: PathBuf,
    llvm_bin: PathBuf,
    /// `rustc -vV` of the toolchain (version, commit, LLVM): part of the cache key.
    version: String,
}

/// Locate the nightly toolchain + rust-src + llvm-tools, or explain how to get them.
fn find_nightly() -> Result<Nightly, Skip> {
    let tc = env::var("SPARSEKIT_NIGHTLY").unwrap_or_else(|_| "nightly".into());
    let install_tc = format!(
        "install it with `rustup toolchain install {tc} --component rust-src --component llvm-tools` \
         (or run scripts/setup-gpu-tools.sh), then `touch build.rs`"
    );
    let out = Command::new("rustup")
        .args(["run", &tc, "rustc", "-vV"])
        .env_remove("RUSTUP_TOOLCHAIN")
        .env("RUSTUP_AUTO_INSTALL", "0") // never download a toolchain from a build script
        .stderr(Stdio::null())
        .output();
    let out = match out {
        Ok(o) if o.status.success() => o,
        Ok(_) => {
            watch_rustup_hashes();
            return Err(Skip(format!(
                "rust toolchain `{tc}` not found; {install_tc}"
            )));
        }
        Err(_) => return Err(Skip(format!("`rustup` not found on PATH; {install_tc}"))),
    };
    let vv = String::from_utf8_lossy(&out.stdout);
    let host = vv
        .lines()
        .find_map(|l| l.strip_prefix("host: "))
        .ok_or_else(|| Skip("cannot parse `rustc -vV`".into()))?
        .trim()
        .to_string();
    let sysroot = Command::new("rustup")
        .args(["run", &tc, "rustc", "--print", "sysroot"])
        .env_remove("RUSTUP_TOOLCHAIN")
        .env("RUSTUP_AUTO_INSTALL", "0")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
        .ok_or_else(|| Skip(format!("`rustc +{tc} --print sysroot` failed")))?;

    let rustlib = sysroot.join("lib/rustlib");
    let llvm_bin = rustlib.join(&host).join("bin");
    let mut missing = Vec::new();
    if !rustlib.join("src/rust/library/core/Cargo.toml").is_file() {
        missing.push("rust-src");
    }
    if !llvm_bin.join(exe("llc")).is_file() || !llvm_bin.join(exe("llvm-link")).is_file() {
        missing.push("llvm-tools");
    }
    if !missing.is_empty() {
        // `rustup component add` rewrites this file: rerun once it changes.
        let components = rustlib.join("components");
        if components.is_file() {
            println!("cargo:rerun-if-changed={}", components.display());
        }
        return Err(Skip(format!(
            "toolchain `{tc}` lacks {}; install with `rustup component add {} --toolchain {tc}`",
            missing.join(" + "),
            missing.join(" "),
        )));
    }
    Ok(Nightly {
        sysroot,
        llvm_bin,
        version: vv.into_owned(),
    })
}

/// When the nightly toolchain is missing, rerun once rustup installs one
/// (rustup writes `$RUSTUP_HOME/update-hashes/<toolchain>`). Only watched if it
/// exists: a missing rerun-if-changed path would make every build rerun us.
fn watch_rustup_hashes() {
    let home = env::var_os("RUSTUP_HOME")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| PathBuf::from(h).join(".rustup")));
    if let Some(dir) = home.map(|h| h.join("update-hashes")) {
        if dir.is_dir() {
            println!("cargo:rerun-if-changed={}", dir.display());
        }
    }
}

fn exe(name: &str) -> String {
    format!("{name}{}", env::consts::EXE_SUFFIX)
}

fn build_all(manifest_dir: &Path, kernels_dir: &Path, out_dir: &Path) -> Result<Vec<Built>, Skip> {
    let nightly = find_nightly()?;
    let target_dir = env::var_os("SPARSEKIT_PTX_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| out_dir.join("ptx-target"));
    let bc_dir = target_dir.join("bc");
    fs::create_dir_all(&bc_dir).unwrap();

    let ptxas = find_ptxas(manifest_dir);
    if ptxas.is_none() {
        let msg = "ptxas not found (PTXAS, .tools/bin or PATH): the PTX is built but not \
                   assembled; run scripts/setup-gpu-tools.sh";
        if env_flag("SPARSEKIT_REQUIRE_PTX") {
            return Err(Skip(msg.into()));
        }
        println!("cargo:warning=sparsekit: {msg}");
    }
    let cache = env::var_os("SPARSEKIT_PTX_CACHE")
        .filter(|d| !d.is_empty())
        .map(|d| PathBuf::from(d).join(cache_key(manifest_dir, &nightly, ptxas.as_deref())));
    if let Some(hit) = cache
        .as_deref()
        .and_then(|dir| restore_cached(dir, out_dir))
    {
        return Ok(hit);
    }
    let verbose = env_flag("SPARSEKIT_PTXAS_VERBOSE");
    let mut entries = Vec::new();
    let t0 = Instant::now();
    let mut sys_bc: Option<PathBuf> = None;

    for &(arch, ptx_feature) in ARCHS {
        // 1. rustc -> LLVM bitcode of the kernel crate (core is built once and
        //    shared between archs: NVPTX codegen only honours llc's -mcpu).
        let kernel_bc = bc_dir.join(format!("{KERNEL_CRATE}.{arch}.bc"));
        inner_cargo(&nightly, kernels_dir, &target_dir, arch, &kernel_bc);

        // 2. core + compiler_builtins bitcode (from the -Zbuild-std rlibs).
        let sys = match &sys_bc {
            Some(s) => s.clone(),
            None => {
                let s = build_sys_bc(&nightly, &target_dir);
                sys_bc = Some(s.clone());
                s
            }
        };

        // 3. link, keep only what the #[no_mangle] entry points need.
        let exports = exported_symbols(&nightly, &kernel_bc);
        let linked = bc_dir.join(format!("{KERNEL_CRATE}.{arch}.linked.bc"));
        run(
            Command::new(nightly.llvm_bin.join(exe("llvm-link")))
                .arg(&kernel_bc)
                .arg("--only-needed")
                .arg(&sys)
                .arg("-o")
                .arg(&linked),
            "llvm-link",
        );
        let marked = bc_dir.join(format!("{KERNEL_CRATE}.{arch}.convergent.bc"));
        mark_warp_wide_convergent(&nightly, &linked, &marked);
        let internal = bc_dir.join(format!("{KERNEL_CRATE}.{arch}.final.bc"));
        run(
            Command::new(nightly.llvm_bin.join(exe("opt")))
                .arg("-passes=internalize,globaldce,default<O3>")
                .arg(format!(
                    "-internalize-public-api-list={}",
                    exports.join(",")
                ))
                .arg(&marked)
                .arg("-o")
                .arg(&internal),
            "opt (internalize, O3)",
        );

        // 4. llc -> PTX, at the arch's lowest PTX version (raised for the e4m3 mma).
        let named = Built::named(out_dir, arch);
        let ptx = named.ptx.clone();
        let llc = |feature: &str| {
            run(
                Command::new(nightly.llvm_bin.join(exe("llc")))
                    .args([
                        "-march=nvptx64",
                        &format!("-mcpu={arch}"),
                        &format!("-mattr=+{feature}"),
                    ])
                    .arg("-O3")
                    .arg(&internal)
                    .arg("-o")
                    .arg(&ptx),
                "llc",
            )
        };
        llc(ptx_feature);
        if fs::read_to_string(&ptx).unwrap().contains(".e4m3.e4m3") && ptx_feature < E4M3_PTX {
            llc(E4M3_PTX);
        }
        check_warp_wide(&nightly, &internal, &ptx, arch, &named.warp_ops);

        // 5. ptxas: assemble (errors and spills at sm_90+ fail the build), then summarise
        //    the SASS tensor-core instructions per kernel when cuobjdump is available.
        // The optional files' names, each set again once its file is written.
        let mut built = named;
        let (cubin, log_path, sass_path) = (
            built.cubin.take().unwrap(),
            built.ptxas_log.take().unwrap(),
            built.sass.take().unwrap(),
        );
        if let Some(ptxas) = &ptxas {
            let out = Command::new(ptxas)
                .arg(format!("-arch={arch}"))
                .arg("-v")
                .arg(&ptx)
                .arg("-o")
                .arg(&cubin)
                .output()
                .unwrap_or_else(|e| panic!("cannot run ptxas {}: {e}", ptxas.display()));
            let log = String::from_utf8_lossy(&out.stderr).into_owned();
            fs::write(&log_path, &log).unwrap();
            if !out.status.success() {
                panic!("ptxas -arch={arch} failed on {}:\n{log}", ptx.display());
            }
            let functions = ptxas::parse_ptxas_log(&log);
            if arch != "sm_80" {
                if let Some(f) = functions.iter().find(|f| f.spill_bytes() > 0) {
                    panic!(
                        "register spill at {arch}: {f:?}\nfull log: {}",
                        log_path.display()
                    );
                }
            }
            if verbose {
                for f in &functions {
                    println!("cargo:warning={arch} {f:?}");
                }
            }
            built.ptxas_log = Some(log_path);
            built.cubin = Some(cubin.clone());
            if let Some(sass) = sass_summary(ptxas, &cubin) {
                fs::write(&sass_path, sass).unwrap();
                built.sass = Some(sass_path);
            }
        }
        entries.push(built);
    }
    fs::write(
        out_dir.join("ptx-build-time.txt"),
        format!("{:.2}s\n", t0.elapsed().as_secs_f64()),
    )
    .unwrap();
    if let Some(dir) = &cache {
        store_cached(dir, &entries);
    }
    Ok(entries)
}

/// The cache key of this build: a hash of everything the built files depend on — this
/// script and the ptxas parser it includes, the kernel crate's manifest and sources, the
/// nightly toolchain's version, and which ptxas (with its version) and cuobjdump run.
fn cache_key(manifest_dir: &Path, nightly: &Nightly, ptxas: Option<&Path>) -> String {
    use std::hash::{DefaultHasher, Hasher};
    let mut files = vec![
        manifest_dir.join("build.rs"),
        manifest_dir.join("src/ptxas.rs"),
        manifest_dir.join("kernels-rs/Cargo.toml"),
    ];
    let mut dirs = vec![manifest_dir.join("kernels-rs/src")];
    while let Some(d) = dirs.pop() {
        for e in fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                dirs.push(p);
            } else {
                files.push(p);
            }
        }
    }
    files.sort();
    // Two differently seeded 64-bit hashes: 128 bits of key.
    let mut h = [DefaultHasher::new(), DefaultHasher::new()];
    h[1].write(b"second");
    let mut feed = |bytes: &[u8]| {
        for x in h.iter_mut() {
            x.write_usize(bytes.len());
            x.write(bytes);
        }
    };
    for f in &files {
        feed(
            f.strip_prefix(manifest_dir)
                .unwrap_or(f)
                .to_string_lossy()
                .as_bytes(),
        );
        feed(&fs::read(f).unwrap());
    }
    feed(nightly.version.as_bytes());
    let tool_version = |tool: &Path| {
        let out = Command::new(tool).arg("--version").output();
        let v = out.map(|o| o.stdout).unwrap_or_default();
        format!("{}\n{}", tool.display(), String::from_utf8_lossy(&v))
    };
    match ptxas {
        Some(p) => {
            feed(tool_version(p).as_bytes());
            let cuobjdump = env::var_os("CUOBJDUMP")
                .map(PathBuf::from)
                .or_else(|| p.parent().map(|d| d.join(exe("cuobjdump"))));
            feed(
                cuobjdump
                    .filter(|c| c.is_file())
                    .map(|c| tool_version(&c))
                    .unwrap_or_default()
                    .as_bytes(),
            );
        }
        None => feed(b"no ptxas"),
    }
    format!("{:016x}{:016x}", h[0].finish(), h[1].finish())
}

/// The built files of every arch from the cache entry `dir` into `out_dir`; `None` (build
/// afresh) when the entry is missing or incomplete.
fn restore_cached(dir: &Path, out_dir: &Path) -> Option<Vec<Built>> {
    // Copies the entry's file of `to`'s name to `to`: `Some(false)` where the entry has
    // none, `None` where the copy fails.
    let restore = |to: &Path| -> Option<bool> {
        let from = dir.join(to.file_name()?);
        if !from.is_file() {
            return Some(false);
        }
        fs::copy(&from, to).ok().map(|_| true)
    };
    let mut entries = Vec::new();
    for &(arch, _) in ARCHS {
        let mut built = Built::named(out_dir, arch);
        if !(restore(&built.ptx)? && restore(&built.warp_ops)?) {
            return None;
        }
        // An optional file the entry lacks (no ptxas or cuobjdump) stays absent.
        for slot in [&mut built.ptxas_log, &mut built.sass, &mut built.cubin] {
            if let Some(p) = slot.take() {
                if restore(&p)? {
                    *slot = Some(p);
                }
            }
        }
        entries.push(built);
    }
    fs::write(
        out_dir.join("ptx-build-time.txt"),
        format!("cached: {}\n", dir.display()),
    )
    .ok()?;
    Some(entries)
}

/// Keeps the built files of every arch as the cache entry `dir` (written beside it, then
/// renamed: an entry is complete or absent). A cache that cannot be written is a warning.
fn store_cached(dir: &Path, entries: &[Built]) {
    let tmp = dir.with_extension(format!("tmp{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        fs::create_dir_all(&tmp)?;
        for b in entries {
            let files = [
                Some(&b.ptx),
                Some(&b.warp_ops),
                b.ptxas_log.as_ref(),
                b.sass.as_ref(),
                b.cubin.as_ref(),
            ];
            for f in files.into_iter().flatten() {
                fs::copy(f, tmp.join(f.file_name().unwrap()))?;
            }
        }
        match fs::rename(&tmp, dir) {
            // Another build stored the same entry first.
            Err(_) if dir.is_dir() => fs::remove_dir_all(&tmp),
            r => r,
        }
    };
    if let Err(e) = write() {
        let _ = fs::remove_dir_all(&tmp);
        println!(
            "cargo:warning=sparsekit: cannot keep the PTX in SPARSEKIT_PTX_CACHE ({}): {e}",
            dir.display()
        );
    }
}

/// The environment of the inner (nightly, nvptx64) cargo: the outer cargo
/// exports variables for build scripts that would hijack it.
fn inner_env(cmd: &mut Command, nightly: &Nightly) {
    let keep_cargo = |k: &str| {
        k == "CARGO_HOME"
            || k == "CARGO_MAKEFLAGS" // jobserver of the outer cargo: share its job slots
            || k.starts_with("CARGO_NET_")
            || k.starts_with("CARGO_HTTP_")
            || k.starts_with("CARGO_REGISTRIES_")
            || k.starts_with("CARGO_REGISTRY_")
            || k.starts_with("CARGO_TERM_")
    };
    let vars: Vec<OsString> = env::vars_os().map(|(k, _)| k).collect();
    for k in vars {
        let Some(s) = k.to_str() else { continue };
        let drop = (s == "CARGO" || s.starts_with("CARGO_")) && !keep_cargo(s)
            || s.starts_with("__CARGO")
            || (s.starts_with("RUST") && s != "RUSTUP_HOME" && s != "RUST_BACKTRACE")
            || matches!(
                s,
                "OUT_DIR" | "TARGET" | "HOST" | "NUM_JOBS" | "OPT_LEVEL" | "DEBUG" | "PROFILE"
            );
        if drop {
            cmd.env_remove(&k);
        }
    }
    let bin = nightly.sysroot.join("bin");
    cmd.env("RUSTC", bin.join(exe("rustc")))
        // empty = "no wrapper", also overrides build.rustc-wrapper from .cargo/config.toml
        .env("RUSTC_WRAPPER", "")
        .env("RUSTC_WORKSPACE_WRAPPER", "")
        // Beats RUSTFLAGS / build.rustflags / target.*.rustflags from any config.
        // Applies to core too. immediate-abort: panics become `trap` inline, so no
        // core::panicking / core::fmt code is pulled in.
        .env(
            "CARGO_ENCODED_RUSTFLAGS",
            ["-Zunstable-options", "-Cpanic=immediate-abort"].join("\x1f"),
        )
        .env("CARGO_PROFILE_RELEASE_OPT_LEVEL", "3")
        .env("CARGO_PROFILE_RELEASE_DEBUG", "false")
        .env("CARGO_PROFILE_RELEASE_DEBUG_ASSERTIONS", "false")
        .env("CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS", "false")
        .env("CARGO_PROFILE_RELEASE_LTO", "false")
        .env("CARGO_PROFILE_RELEASE_INCREMENTAL", "false")
        .env("CARGO_PROFILE_RELEASE_PANIC", "abort");
}

fn inner_cargo(nightly: &Nightly, kernels_dir: &Path, target_dir: &Path, arch: &str, bc: &Path) {
    for attempt in 0..2 {
        let mut cmd = Command::new(nightly.sysroot.join("bin").join(exe("cargo")));
        inner_env(&mut cmd, nightly);
        cmd.current_dir(kernels_dir)
            .args([
                "rustc",
                "--lib",
                "--release",
                "--target",
                NVPTX,
                "-Zbuild-std=core",
            ])
            .arg("--manifest-path")
            .arg(kernels_dir.join("Cargo.toml"))
            .arg("--target-dir")
            .arg(target_dir)
            .arg("--")
            .arg(format!("-Ctarget-cpu={arch}"))
            .arg("-Ccodegen-units=1")
            // Unoptimised IR: the warp-wide asm is marked convergent before any LLVM pass
            // (see the file docs); `opt` runs the O3 pipeline afterwards.
            .arg("-Cno-prepopulate-passes")
            .arg(format!("--emit=llvm-bc={}", bc.display()));
        let _ = fs::remove_file(bc);
        run(
            &mut cmd,
            &format!("nightly cargo rustc (kernels-rs, {arch})"),
        );
        if bc.is_file() {
            return;
        }
        // cargo considered the crate fresh although our extra output is gone:
        // drop its fingerprint and retry once.
        let fp = target_dir.join(NVPTX).join("release/.fingerprint");
        if attempt == 0 {
            for e in fs::read_dir(&fp).into_iter().flatten().flatten() {
                if e.file_name()
                    .to_string_lossy()
                    .starts_with("sparsekit-kernels-")
                {
                    let _ = fs::remove_dir_all(e.path());
                }
            }
        }
    }
    panic!("inner cargo did not produce {}", bc.display());
}

/// Extract the bitcode members (`*.rcgu.o`; nvptx objects *are* LLVM bitcode)
/// of the newest core / compiler_builtins rlibs and llvm-link them into one
/// module. Linking all CGUs together first matters: `llvm-link --only-needed`
/// with many inputs misses symbols that later inputs need from earlier ones.
fn build_sys_bc(nightly: &Nightly, target_dir: &Path) -> PathBuf {
    let deps = target_dir.join(NVPTX).join("release/deps");
    let mut rlibs = Vec::new();
    for krate in ["core", "compiler_builtins"] {
        let prefix = format!("lib{krate}-");
        let newest = fs::read_dir(&deps)
            .unwrap()
            .flatten()
            .filter(|e| {
                let n = e.file_name().to_string_lossy().into_owned();
                n.starts_with(&prefix) && n.ends_with(".rlib")
            })
            .max_by_key(|e| e.metadata().and_then(|m| m.modified()).ok())
            .unwrap_or_else(|| panic!("no {prefix}*.rlib in {}", deps.display()))
            .path();
        rlibs.push(newest);
    }
    let sys = target_dir.join("bc/sys.bc");
    let newest_input = rlibs
        .iter()
        .filter_map(|p| p.metadata().and_then(|m| m.modified()).ok())
        .max();
    let sys_time = sys.metadata().and_then(|m| m.modified()).ok();
    if sys_time.is_some() && sys_time >= newest_input {
        return sys;
    }
    let ex = target_dir.join("bc/sys-objs");
    let _ = fs::remove_dir_all(&ex);
    let mut objs = Vec::new();
    for (i, rlib) in rlibs.iter().enumerate() {
        let d = ex.join(i.to_string());
        fs::create_dir_all(&d).unwrap();
        run(
            Command::new(nightly.llvm_bin.join(exe("llvm-ar")))
                .arg("x")
                .arg(rlib)
                .current_dir(&d),
            "llvm-ar x",
        );
        for e in fs::read_dir(&d).unwrap().flatten() {
            if e.file_name().to_string_lossy().ends_with(".rcgu.o") {
                objs.push(e.path());
            }
        }
    }
    objs.sort();
    run(
        Command::new(nightly.llvm_bin.join(exe("llvm-link")))
            .args(&objs)
            .arg("-o")
            .arg(&sys),
        "llvm-link (core + compiler_builtins)",
    );
    let _ = fs::remove_dir_all(&ex);
    sys
}

/// Defined, externally visible, unmangled symbols of the kernel crate, i.e. the
/// `#[no_mangle]` entry points (the panic handler `_RNv...rust_begin_unwind`
/// and other Rust-mangled names get internalized and dropped).
fn exported_symbols(nightly: &Nightly, bc: &Path) -> Vec<String> {
    let out = Command::new(nightly.llvm_bin.join(exe("llvm-nm")))
        .args(["--defined-only", "--extern-only", "--just-symbol-name"])
        .arg(bc)
        .output()
        .expect("llvm-nm");
    assert!(out.status.success(), "llvm-nm failed on {}", bc.display());
    let syms: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::trim)
        .filter(|s| !s.is_empty() && !s.starts_with("_R") && !s.starts_with("_ZN"))
        .map(String::from)
        .collect();
    assert!(
        !syms.is_empty(),
        "no #[no_mangle] kernels exported by {}",
        bc.display()
    );
    syms
}

fn find_ptxas(manifest_dir: &Path) -> Option<PathBuf> {
    if let Some(p) = env::var_os("PTXAS").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        assert!(p.is_file(), "PTXAS={} does not exist", p.display());
        return Some(p);
    }
    for rel in [".tools/bin", ".tools/cuda/nvidia/cu13/bin"] {
        let p = manifest_dir.join(rel).join(exe("ptxas"));
        if p.is_file() {
            println!("cargo:rerun-if-changed={}", p.display());
            return Some(p);
        }
    }
    env::var_os("PATH").and_then(|paths| {
        env::split_paths(&paths)
            .map(|d| d.join(exe("ptxas")))
            .find(|p| p.is_file())
    })
}

fn run(cmd: &mut Command, what: &str) {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("failed to spawn {what} ({:?}): {e}", cmd.get_program()));
    if !out.status.success() {
        panic!(
            "{what} failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Built {
    /// Where every file of `arch` goes in `out_dir` (each optional one as present).
    fn named(out_dir: &Path, arch: &str) -> Built {
        Built {
            arch: arch.to_string(),
            ptx: out_dir.join(format!("{KERNEL_CRATE}.{arch}.ptx")),
            ptxas_log: Some(out_dir.join(format!("ptxas.{arch}.log"))),
            sass: Some(out_dir.join(format!("sass.{arch}.tsv"))),
            cubin: Some(out_dir.join(format!("{KERNEL_CRATE}.{arch}.cubin"))),
            warp_ops: out_dir.join(format!("warp_ops.{arch}.tsv")),
        }
    }
}

/// What was built for one arch.
struct Built {
    arch: String,
    ptx: PathBuf,
    /// `ptxas -v` output, when ptxas ran.
    ptxas_log: Option<PathBuf>,
    /// Per-kernel SASS tensor-core counts (`name\tHMMA\tQMMA` lines), when cuobjdump ran.
    sass: Option<PathBuf>,
    /// The SASS ptxas assembled for the arch, when ptxas ran.
    cubin: Option<PathBuf>,
    /// Per-function warp-wide instruction counts (`name\tmma\tshfl\tvote\tbar`).
    warp_ops: PathBuf,
}

/// `cuobjdump --dump-sass` of a cubin summarised per function: `name\tHMMA\tQMMA`.
/// cuobjdump is looked up beside ptxas (or `CUOBJDUMP`); it needs nvdisasm on its PATH.
fn sass_summary(ptxas: &Path, cubin: &Path) -> Option<String> {
    let dir = ptxas.parent()?;
    let cuobjdump = env::var_os("CUOBJDUMP")
        .map(PathBuf::from)
        .unwrap_or_else(|| dir.join(exe("cuobjdump")));
    if !cuobjdump.is_file() {
        return None;
    }
    let path = env::join_paths(
        std::iter::once(cuobjdump.parent()?.to_path_buf()).chain(
            env::var_os("PATH")
                .map(|p| env::split_paths(&p).collect::<Vec<_>>())
                .unwrap_or_default(),
        ),
    )
    .ok()?;
    let out = Command::new(&cuobjdump)
        .arg("--dump-sass")
        .arg(cubin)
        .env("PATH", path)
        .output()
        .ok()?;
    if !out.status.success() {
        println!(
            "cargo:warning=cuobjdump --dump-sass failed (no tensor-core summary): {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        return None;
    }
    Some(ptxas::sass_to_tsv(&ptxas::parse_sass(
        &String::from_utf8_lossy(&out.stdout),
    )))
}

fn write_generated(out_dir: &Path, entries: &[Built], info: &str) {
    let mut s = String::new();
    s.push_str("// @generated by build.rs\n");
    s.push_str(
        "/// `(arch, ptx)` for every SM arch the kernels were built for; empty if skipped.\n",
    );
    s.push_str("pub static PTX: &[(&str, &str)] = &[\n");
    for b in entries {
        let p = b.ptx.to_str().expect("non-UTF-8 OUT_DIR");
        writeln!(s, "    ({:?}, include_str!({p:?})),", b.arch).unwrap();
    }
    s.push_str("];\n");
    s.push_str("/// `(arch, ptxas -v log)` for every arch ptxas assembled.\n");
    s.push_str("pub static PTXAS_LOGS: &[(&str, &str)] = &[\n");
    for b in entries {
        if let Some(l) = &b.ptxas_log {
            let p = l.to_str().expect("non-UTF-8 OUT_DIR");
            writeln!(s, "    ({:?}, include_str!({p:?})),", b.arch).unwrap();
        }
    }
    s.push_str("];\n");
    s.push_str("/// `(arch, cubin)`: the SASS ptxas built for every arch it assembled.\n");
    s.push_str("pub static CUBINS: &[(&str, &[u8])] = &[\n");
    for b in entries {
        if let Some(c) = &b.cubin {
            let p = c.to_str().expect("non-UTF-8 OUT_DIR");
            writeln!(s, "    ({:?}, include_bytes!({p:?})),", b.arch).unwrap();
        }
    }
    s.push_str("];\n");
    s.push_str(
        "/// `(arch, lines of `function\\tmma\\tshfl\\tvote\\tbar`)`: warp-wide instructions per function.\n",
    );
    s.push_str("pub static WARP_OPS: &[(&str, &str)] = &[\n");
    for b in entries {
        let p = b.warp_ops.to_str().expect("non-UTF-8 OUT_DIR");
        writeln!(s, "    ({:?}, include_str!({p:?})),", b.arch).unwrap();
    }
    s.push_str("];\n");
    s.push_str("/// `(arch, lines of `kernel\\tHMMA\\tQMMA`)` from the SASS of every arch.\n");
    s.push_str("pub static SASS_TENSOR_OPS: &[(&str, &str)] = &[\n");
    for b in entries {
        if let Some(l) = &b.sass {
            let p = l.to_str().expect("non-UTF-8 OUT_DIR");
            writeln!(s, "    ({:?}, include_str!({p:?})),", b.arch).unwrap();
        }
    }
    s.push_str("];\n");
    writeln!(
        s,
        "/// `\"built\"` or `\"skipped: …\"`.\npub const PTX_BUILD_INFO: &str = {info:?};"
    )
    .unwrap();
    let path = out_dir.join("ptx_kernels.rs");
    // Only rewrite when changed, so the lib is not recompiled needlessly.
    if fs::read_to_string(&path).ok().as_deref() != Some(s.as_str()) {
        fs::write(&path, s).unwrap();
    }
}

/// Marks every inline asm call of a warp-wide instruction in `input` (bitcode) as
/// `convergent` (llvm-dis, text edit, llvm-as) into `output`. Fails the build when none is
/// found (the kernels use `mma.sync`: a change of rustc's asm syntax must not silently
/// disable the marking).
fn mark_warp_wide_convergent(nightly: &Nightly, input: &Path, output: &Path) {
    let dis = Command::new(nightly.llvm_bin.join(exe("llvm-dis")))
        .arg(input)
        .arg("-o")
        .arg("-")
        .output()
        .expect("llvm-dis");
    assert!(
        dis.status.success(),
        "llvm-dis failed on {}",
        input.display()
    );
    let ll = String::from_utf8(dis.stdout).expect("LLVM IR is UTF-8");
    let (marked, n) = ptxas::mark_convergent(&ll, WARP_WIDE_ASM);
    assert!(
        n > 0,
        "no warp-wide inline asm found to mark convergent in {}",
        input.display()
    );
    let ll_path = output.with_extension("ll");
    fs::write(&ll_path, marked).unwrap();
    run(
        Command::new(nightly.llvm_bin.join(exe("llvm-as")))
            .arg(&ll_path)
            .arg("-o")
            .arg(output),
        "llvm-as (convergent warp-wide asm)",
    );
}

/// The build-time check of the warp-wide instructions: per function, the `mma.sync`,
/// `shfl.sync`, `vote.sync` and barrier instructions of the PTX are exactly the warp-wide
/// calls of the optimised IR that llc compiled, and every one of those calls is
/// `convergent` (so no LLVM pass could move or duplicate it into divergent control flow).
/// Writes the counts to `warp_ops` (`warp_ops.<arch>.tsv`, embedded for `sparsekit kernels`).
fn check_warp_wide(nightly: &Nightly, final_bc: &Path, ptx: &Path, arch: &str, warp_ops: &Path) {
    let dis = Command::new(nightly.llvm_bin.join(exe("llvm-dis")))
        .arg(final_bc)
        .arg("-o")
        .arg("-")
        .output()
        .expect("llvm-dis");
    assert!(
        dis.status.success(),
        "llvm-dis failed on {}",
        final_bc.display()
    );
    let ll = String::from_utf8(dis.stdout).expect("LLVM IR is UTF-8");
    let ir = ptxas::ir_warp_ops(&ll, WARP_WIDE_ASM);
    if let Some(f) = ir.iter().find(|f| f.non_convergent > 0) {
        panic!(
            "{arch}: {} warp-wide call(s) of {} are not convergent in the optimised IR",
            f.non_convergent, f.name
        );
    }
    let ptx_text = fs::read_to_string(ptx).unwrap();
    let ptx_ops = ptxas::ptx_warp_ops(&ptx_text);
    let mut tsv = String::new();
    for p in &ptx_ops {
        let want = ir
            .iter()
            .find(|f| f.name == p.name)
            .map(|f| f.ops)
            .unwrap_or_default();
        if want != p.ops {
            panic!(
                "{arch}: function {} has warp-wide instructions {:?} in the PTX but issues \
                 {:?} in the IR llc compiled: llc moved, merged or duplicated a warp-wide \
                 instruction (see {})",
                p.name,
                p.ops,
                want,
                ptx.display()
            );
        }
        writeln!(
            tsv,
            "{}\t{}\t{}\t{}\t{}",
            p.name, p.ops.mma, p.ops.shfl, p.ops.vote, p.ops.bar
        )
        .unwrap();
    }
    for f in &ir {
        if f.ops != ptxas::WarpOps::default() && !ptx_ops.iter().any(|p| p.name == f.name) {
            panic!(
                "{arch}: {} issues warp-wide calls but is missing from the PTX",
                f.name
            );
        }
    }
    fs::write(warp_ops, tsv).unwrap();
}
