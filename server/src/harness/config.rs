//! The evidence table's configurations and the harness-level fault injections.
//!
//! A [`ConfigKey`] is one row kind of the table: index-K dtype × host tier × PD. Which
//! of them a run covers is chosen with [`select`] (`--configs`), who runs each is a
//! [`crate::harness::deploy::ConfigRunner`] (the in-process runner covers PD off; the PD
//! runner plugs in beside it).
//!
//! An [`Injection`] re-creates one historical bug through the cache's fault injections,
//! paired so that it bypasses one check and leaves the next one to catch it:
//!
//! | injection | bypasses | caught by (on unless `--no-verify`) | affects |
//! |---|---|---|---|
//! | `host-pool-fp8-layout` | layout fingerprints (`host-pool-fp8-layout` + `no-layout-check`) | load checksums | bf16, host tier on |
//! | `shared-item-size` | — (fingerprints cannot see strides) | load checksums | host tier on |
//! | `skip-index-wait` | layer fences (`skip-index-wait` + `loads-trail-readers`) | landed stamps | host tier on |
//! | `no-generation-check` | generations (`no-generation-check` + `late-write`) | landed stamps, written slots | every cache config |
//! | `index-k-after-publish` | layer fences (index-K copied after its layer was published) | per-kind landed stamps (the read waits) | host tier on |
//! | `radix-overreach` | the prefix match (one token more than matched) | written slots (the request recomputes) | every cache config |
//! | `kernel-wrong-slot` | — (a top-k bug in the served engines) | kernel checks | every config |
//! | `host-tier-skips-index-k` | — (the backup skips index-K, SGLang 17085) | host copy records (and load checksums) | host tier on |
//! | `reload-kv-only` | — (a load skips index-K, Mooncake 2236) | load checksums (and per-kind landed stamps) | host tier on |
//! | `compressor-state-lost` | — (backups leave the V4 compressor's state out) | host copy records (and load checksums) | V4 models, host tier on |
//! | `pool-page-size-mismatch` | layout fingerprints (the backup strides the compressed pools with the window's page size) | load checksums | V4 models, host tier on |
//! | `model1-scales-as-interleaved` | — (prefill copies a partly filled model1_fp8 page as token-interleaved: the tile scales stay behind) | PD per-page checksums | V4 models with `--kv fp8_ds_mla` (model1_fp8), PD on |
//!
//! `--no-verify` turns the second checks off (load checksums, landed stamps); with it each
//! injection must corrupt sessions, without it each must be caught with 0 corrupted.
//! The PD injections (`pd-fp8-frame`, `pd-read-before-landed`, `stale-transfer-write`,
//! `model1-scales-as-interleaved`) affect PD configs only and are the PD runner's to apply.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;
use sparsekit_host::cache::Fault;
use sparsekit_host::IndexKDtype;

use crate::engine::kernel_check::KernelFault;
use crate::error::EngineError;
use crate::pd::PdFault;

/// One configuration of the evidence table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConfigKey {
    pub index_k: IndexKDtype,
    pub host_tier: bool,
    pub pd: bool,
    /// PD on with a decode pool far smaller than the load (room for about two requests
    /// at once): requests wait for decode pages behind transfers, and must never wedge.
    pub small_decode: bool,
}

/// `fp8`, `bf16` or `fp4`.
pub fn index_k_name(d: IndexKDtype) -> &'static str {
    match d {
        IndexKDtype::Bf16 => "bf16",
        IndexKDtype::Fp8E4m3 { .. } => "fp8",
        IndexKDtype::Fp4E2m1 => "fp4",
    }
}

fn on_off(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

impl ConfigKey {
    /// The nine configurations, in table order: index-K dtype × host tier × PD, then
    /// `bf16/host-on/pd-on/decode-small`.
    pub fn all() -> Vec<ConfigKey> {
        let mut v = Vec::new();
        for index_k in [IndexKDtype::FP8, IndexKDtype::Bf16] {
            for host_tier in [false, true] {
                for pd in [false, true] {
                    v.push(ConfigKey {
                        index_k,
                        host_tier,
                        pd,
                        small_decode: false,
                    });
                }
            }
        }
        v.push(ConfigKey {
            index_k: IndexKDtype::Bf16,
            host_tier: true,
            pd: true,
            small_decode: true,
        });
        v
    }

    /// `fp8/host-off/pd-off` and so on (`…/decode-small` for the small decode pool).
    pub fn name(&self) -> String {
        format!(
            "{}/host-{}/pd-{}{}",
            index_k_name(self.index_k),
            on_off(self.host_tier),
            on_off(self.pd),
            if self.small_decode {
                "/decode-small"
            } else {
                ""
            }
        )
    }

    /// The same configuration with the host tier off (the speed-up's baseline).
    pub fn without_host_tier(&self) -> ConfigKey {
        ConfigKey {
            host_tier: false,
            ..*self
        }
    }

    pub fn host_tier_label(&self) -> &'static str {
        on_off(self.host_tier)
    }

    pub fn pd_label(&self) -> &'static str {
        on_off(self.pd)
    }
}

impl fmt::Display for ConfigKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// The configurations `filters` select: each filter is `/`-separated parts (`fp8`,
/// `bf16`, `host-on`, `host-off`, `pd-on`, `pd-off`, `decode-small`, or `all`), and a
/// configuration is selected when every part of some filter names it (the
/// `decode-small` variant only when a filter names `decode-small` or `all`). An empty
/// list selects all nine.
pub fn select(filters: &[String]) -> Result<Vec<ConfigKey>, EngineError> {
    let all = ConfigKey::all();
    if filters.is_empty() {
        return Ok(all);
    }
    let mut chosen = Vec::new();
    for f in filters {
        let parts: Vec<&str> = f
            .split('/')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .collect();
        for p in &parts {
            if !matches!(
                *p,
                "all"
                    | "fp8"
                    | "bf16"
                    | "host-on"
                    | "host-off"
                    | "pd-on"
                    | "pd-off"
                    | "decode-small"
            ) {
                return Err(EngineError::InvalidRequest(format!(
                    "unknown config part {p:?} in {f:?} (parts: fp8, bf16, host-on, \
                     host-off, pd-on, pd-off, decode-small, all; e.g. bf16/host-on/pd-off)"
                )));
            }
        }
        let mut hit = false;
        for c in &all {
            let name = c.name();
            let names: Vec<&str> = name.split('/').collect();
            // The small decode pool is a variant: selected by naming it (or `all`).
            let variant_named =
                !c.small_decode || parts.iter().any(|p| *p == "decode-small" || *p == "all");
            if variant_named && parts.iter().all(|p| *p == "all" || names.contains(p)) {
                hit = true;
                if !chosen.contains(c) {
                    chosen.push(*c);
                }
            }
        }
        if !hit {
            return Err(EngineError::InvalidRequest(format!(
                "--configs {f:?} selects no configuration"
            )));
        }
    }
    chosen.sort_by_key(|c| all.iter().position(|a| a == c));
    Ok(chosen)
}

/// A harness-level fault injection (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Injection {
    HostPoolFp8Layout,
    SharedItemSize,
    SkipIndexWait,
    NoGenerationCheck,
    PdFp8Frame,
    PdReadBeforeLanded,
    StaleTransferWrite,
    IndexKAfterPublish,
    RadixOverreach,
    KernelWrongSlot,
    HostTierSkipsIndexK,
    ReloadKvOnly,
    CompressorStateLost,
    PoolPageSizeMismatch,
    Model1ScalesAsInterleaved,
}

impl Injection {
    pub const ALL: [Injection; 15] = [
        Injection::HostPoolFp8Layout,
        Injection::SharedItemSize,
        Injection::SkipIndexWait,
        Injection::NoGenerationCheck,
        Injection::PdFp8Frame,
        Injection::PdReadBeforeLanded,
        Injection::StaleTransferWrite,
        Injection::IndexKAfterPublish,
        Injection::RadixOverreach,
        Injection::KernelWrongSlot,
        Injection::HostTierSkipsIndexK,
        Injection::ReloadKvOnly,
        Injection::CompressorStateLost,
        Injection::PoolPageSizeMismatch,
        Injection::Model1ScalesAsInterleaved,
    ];

    pub fn name(&self) -> &'static str {
        match self {
            Injection::HostPoolFp8Layout => "host-pool-fp8-layout",
            Injection::SharedItemSize => "shared-item-size",
            Injection::SkipIndexWait => "skip-index-wait",
            Injection::NoGenerationCheck => "no-generation-check",
            Injection::PdFp8Frame => "pd-fp8-frame",
            Injection::PdReadBeforeLanded => "pd-read-before-landed",
            Injection::StaleTransferWrite => "stale-transfer-write",
            Injection::IndexKAfterPublish => "index-k-after-publish",
            Injection::RadixOverreach => "radix-overreach",
            Injection::KernelWrongSlot => "kernel-wrong-slot",
            Injection::HostTierSkipsIndexK => "host-tier-skips-index-k",
            Injection::ReloadKvOnly => "reload-kv-only",
            Injection::CompressorStateLost => "compressor-state-lost",
            Injection::PoolPageSizeMismatch => "pool-page-size-mismatch",
            Injection::Model1ScalesAsInterleaved => "model1-scales-as-interleaved",
        }
    }

    /// Whether it needs a DeepSeek-V4 model (its compressor state, its pools of different
    /// page sizes, its model1_fp8 pages) to exist at all (`repro --model dsv4-tiny`).
    pub fn needs_v4(&self) -> bool {
        matches!(
            self,
            Injection::CompressorStateLost
                | Injection::PoolPageSizeMismatch
                | Injection::Model1ScalesAsInterleaved
        )
    }

    /// Whether it needs fp8 KV pages (a V4 model stores them as model1_fp8: `--kv
    /// fp8_ds_mla`) to exist at all.
    pub fn needs_fp8_kv(&self) -> bool {
        matches!(self, Injection::Model1ScalesAsInterleaved)
    }

    /// Whether it needs PD (a transfer between two engines) to exist at all.
    pub fn needs_pd(&self) -> bool {
        matches!(
            self,
            Injection::PdFp8Frame
                | Injection::PdReadBeforeLanded
                | Injection::StaleTransferWrite
                | Injection::Model1ScalesAsInterleaved
        )
    }

    /// The cache faults that re-create it in one engine's cache (empty for the PD ones,
    /// which live in the transfer).
    pub fn cache_faults(&self) -> Vec<Fault> {
        match self {
            Injection::HostPoolFp8Layout => vec![Fault::HostPoolFp8Layout, Fault::NoLayoutCheck],
            Injection::SharedItemSize => vec![Fault::SharedItemSize],
            Injection::SkipIndexWait => vec![Fault::SkipIndexWait, Fault::LoadsTrailReaders],
            Injection::NoGenerationCheck => vec![Fault::NoGenerationCheck, Fault::LateWrite],
            Injection::IndexKAfterPublish => vec![Fault::IndexKAfterPublish],
            Injection::RadixOverreach => vec![Fault::RadixOverreach],
            Injection::HostTierSkipsIndexK => vec![Fault::HostTierSkipsIndexK],
            Injection::ReloadKvOnly => vec![Fault::ReloadKvOnly],
            Injection::CompressorStateLost => vec![Fault::CompressorStateLost],
            // The descriptor comparison would refuse the copy: bypass it, so that the
            // misplaced host copies must be caught by what comes next.
            Injection::PoolPageSizeMismatch => {
                vec![Fault::PoolPageSizeMismatch, Fault::NoLayoutCheck]
            }
            _ => Vec::new(),
        }
    }

    /// The kernel bug that re-creates it in the served engines (`None` for the others).
    pub fn kernel_fault(&self) -> Option<KernelFault> {
        match self {
            Injection::KernelWrongSlot => Some(KernelFault::TopkWrongSlot),
            _ => None,
        }
    }

    /// Whether the checks that catch it can also keep the sessions right (the cache
    /// checks refuse, wait or recompute); a kernel bug can only be detected.
    pub fn preventable(&self) -> bool {
        self.kernel_fault().is_none()
    }

    /// Whether it can bite configuration `c` (the others run it and must stay clean).
    pub fn affects(&self, c: &ConfigKey) -> bool {
        match self {
            Injection::HostPoolFp8Layout => c.host_tier && c.index_k == IndexKDtype::Bf16,
            Injection::SharedItemSize | Injection::SkipIndexWait => c.host_tier,
            Injection::IndexKAfterPublish
            | Injection::HostTierSkipsIndexK
            | Injection::ReloadKvOnly
            | Injection::CompressorStateLost
            | Injection::PoolPageSizeMismatch => c.host_tier,
            Injection::NoGenerationCheck | Injection::RadixOverreach => true,
            Injection::KernelWrongSlot => true,
            // The fp8 frame of an fp8 index-K page is the right frame.
            Injection::PdFp8Frame => c.pd && c.index_k == IndexKDtype::Bf16,
            _ => c.pd,
        }
    }

    /// The PD fault that re-creates it in a prefill/decode pair (`None` for the others).
    pub fn pd_fault(&self) -> Option<PdFault> {
        match self {
            Injection::PdFp8Frame => Some(PdFault::Fp8Frame),
            Injection::PdReadBeforeLanded => Some(PdFault::ReadBeforeLanded),
            Injection::StaleTransferWrite => Some(PdFault::StaleTransferWrite),
            Injection::Model1ScalesAsInterleaved => Some(PdFault::Model1ScalesAsInterleaved),
            _ => None,
        }
    }

    /// The check that catches it while the checks are on.
    pub fn caught_by(&self) -> &'static str {
        match self {
            Injection::HostPoolFp8Layout | Injection::SharedItemSize => "load checksums",
            Injection::SkipIndexWait | Injection::NoGenerationCheck => "landed stamps",
            Injection::PdFp8Frame => "frame fingerprints",
            Injection::PdReadBeforeLanded => "landed stamps",
            Injection::StaleTransferWrite => "generations and quarantine",
            Injection::IndexKAfterPublish => "per-kind landed stamps",
            Injection::RadixOverreach => "written slots",
            Injection::KernelWrongSlot => "kernel checks",
            Injection::HostTierSkipsIndexK => "host copy records",
            Injection::ReloadKvOnly => "load checksums",
            Injection::CompressorStateLost => "host copy records",
            Injection::PoolPageSizeMismatch => "load checksums",
            Injection::Model1ScalesAsInterleaved => "PD checksums",
        }
    }
}

impl FromStr for Injection {
    type Err = EngineError;
    fn from_str(s: &str) -> Result<Self, EngineError> {
        Injection::ALL
            .into_iter()
            .find(|i| i.name() == s)
            .ok_or_else(|| {
                EngineError::InvalidRequest(format!(
                    "unknown injection {s:?} (known: {})",
                    Injection::ALL.map(|i| i.name()).join(", ")
                ))
            })
    }
}

/// The cache faults that turn the second checks off (`--no-verify`, with the load
/// checksums off as well: `CacheOptions::verify = false`).
pub fn no_verify_faults() -> Vec<Fault> {
    vec![Fault::NoLandedCheck]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selection_by_parts() {
        assert_eq!(select(&[]).unwrap_or_default().len(), 9);
        let v = select(&["bf16/host-on".into()]).unwrap_or_default();
        assert_eq!(
            v.iter().map(ConfigKey::name).collect::<Vec<_>>(),
            ["bf16/host-on/pd-off", "bf16/host-on/pd-on"]
        );
        assert_eq!(select(&["all".into()]).unwrap_or_default().len(), 9);
        let v = select(&["decode-small".into()]).unwrap_or_default();
        assert_eq!(v.len(), 1);
        assert!(v[0].small_decode);
        let v = select(&["pd-off".into(), "fp8/host-off/pd-off".into()]).unwrap_or_default();
        assert_eq!(v.len(), 4, "duplicates once, table order");
        assert_eq!(v[0].name(), "fp8/host-off/pd-off");
        assert!(select(&["fp9".into()]).is_err());
        assert!(select(&["fp8/bf16".into()]).is_err(), "selects nothing");
    }

    #[test]
    fn injections_parse_and_pair() {
        for i in Injection::ALL {
            assert_eq!(i.name().parse::<Injection>().ok(), Some(i));
            assert_eq!(
                i.cache_faults().is_empty(),
                i.needs_pd() || i.kernel_fault().is_some()
            );
        }
        assert!("nope".parse::<Injection>().is_err());
        let bf16_host = ConfigKey {
            index_k: IndexKDtype::Bf16,
            host_tier: true,
            pd: false,
            small_decode: false,
        };
        assert!(Injection::HostPoolFp8Layout.affects(&bf16_host));
        assert!(!Injection::HostPoolFp8Layout.affects(&ConfigKey {
            index_k: IndexKDtype::FP8,
            ..bf16_host
        }));
        assert!(!Injection::SkipIndexWait.affects(&bf16_host.without_host_tier()));
        assert!(!Injection::PdFp8Frame.affects(&bf16_host));
    }
}
