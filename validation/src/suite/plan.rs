//! The plan of a suite run: which cases run, in order, at which sizes.

use sparsekit_host::dims::ModelDims;
use sparsekit_host::dims::V4Dims;
use sparsekit_host::dtype::ScaleFormat;
use sparsekit_host::layout::{IndexKDtype, KvDtype, PageLayout};
use sparsekit_host::ops::{Op, ShortRows};

use super::{Check, SinkKind, Size, SuiteConfig, V4CacheShape, V4Shape};
use crate::fixtures::{page_layouts, v4_page_layouts, Scenario};
use crate::tolerance::DataType;

/// One planned check.
#[derive(Clone, Debug)]
pub struct Case {
    /// Position in the plan; mixed into the seed.
    pub id: u64,
    pub op: Op,
    pub check: Check,
    pub config: String,
    pub dtype: DataType,
    pub batch: usize,
    pub(super) kind: Kind,
}

/// The query form of an indexer case.
#[derive(Clone, Debug)]
pub(super) enum Form {
    /// `next_n` queries per request over its whole context.
    Decode(usize),
    /// Prefill rows, some with a window `start > 0`.
    Prefill,
}

/// What a case runs, with its parameters.
#[derive(Clone, Debug)]
pub(super) enum Kind {
    IndexKStore(ModelDims, IndexKDtype),
    KvStore(ModelDims, KvDtype),
    /// A DeepSeek-V4 KV layout and its page size.
    KvStoreV4(KvDtype, usize),
    IndexerLogits(ModelDims, IndexKDtype, Form, Vec<u32>),
    Topk(usize, usize, Scenario, Vec<u32>, ShortRows),
    SparseMla(ModelDims, KvDtype, usize, Vec<u32>),
    /// The near-cancellation case of the derived `out` bound.
    SparseMlaCancel(ModelDims, KvDtype),
    /// DeepSeek-V4's sparse attention.
    SparseMlaV4(V4Shape),
    CopyPages(PageLayout, bool),
    PageChecksums(PageLayout),
    Invariance(ModelDims, Op),
}

/// Index-K dtypes of the cases (both fp8 scale formats, and DeepSeek-V4's fp4).
const INDEX_DTYPES: [IndexKDtype; 4] = [
    IndexKDtype::FP8,
    IndexKDtype::Fp8E4m3 {
        scale: ScaleFormat::Ue8m0,
    },
    IndexKDtype::Bf16,
    IndexKDtype::Fp4E2m1,
];
/// The tiny dims at odd page sizes.
const TINY_P1: ModelDims = ModelDims {
    name: "tiny P=1",
    page_size: 1,
    ..ModelDims::TINY
};
const TINY_P37: ModelDims = ModelDims {
    name: "tiny P=37",
    page_size: 37,
    ..ModelDims::TINY
};
/// DeepSeek-V3.2's dims at an odd page size (fp4 index keys need head_dim 128).
const DSV32_P37: ModelDims = ModelDims {
    name: "dsv32 P=37",
    page_size: 37,
    ..ModelDims::DSV32
};

/// The index-K dtypes of a config: fp4 only where the head dim allows it (a multiple of
/// 128), and only fp4 at [`DSV32_P37`] (the others run at the tiny odd page sizes).
fn index_dtypes(dims: &ModelDims) -> Vec<IndexKDtype> {
    INDEX_DTYPES
        .into_iter()
        .filter(|dt| {
            let fp4 = *dt == IndexKDtype::Fp4E2m1;
            (!fp4 || dims.index_head_dim % 128 == 0) && (fp4 || *dims != DSV32_P37)
        })
        .collect()
}

/// DeepSeek-V4's KV dtypes.
const V4_KV_DTYPES: [KvDtype; 2] = [KvDtype::Model1Fp8, KvDtype::Bf16x512];
/// Page sizes of the V4 store and page cases: the window pool (256), the ratio-4 pools
/// (64), the ratio-128 pool (2), and odd ones (1, 37, 1024).
const V4_PAGES: [usize; 6] = [256, 64, 2, 1, 37, 1024];
/// KV dtypes of the cases.
const KV_DTYPES: [KvDtype; 2] = [KvDtype::Bf16, KvDtype::Fp8DsMla];

/// Config-name suffix of an index-K dtype (the ue8m0 scale format is named).
fn scale_suffix(d: IndexKDtype) -> &'static str {
    match d {
        IndexKDtype::Fp8E4m3 {
            scale: ScaleFormat::Ue8m0,
        } => " ue8m0",
        _ => "",
    }
}

/// The checks of a suite run, in order.
pub fn plan(cfg: &SuiteConfig) -> Vec<Case> {
    let full = cfg.size == Size::Full;
    let mut cases = Vec::new();
    let mut push = |op: Op, check, config: String, dtype, batch, kind| {
        if cfg.ops.is_empty() || cfg.ops.contains(&op) {
            cases.push(Case {
                id: cases.len() as u64,
                op,
                check,
                config,
                dtype,
                batch,
                kind,
            });
        }
    };
    let r = Check::Reference;
    // DeepSeek-V4 KV stores and page copies, every pool's page size and odd ones.
    for dt in V4_KV_DTYPES {
        for ps in V4_PAGES {
            push(
                Op::KvStore,
                r,
                format!("dsv4 P={ps}"),
                dt.into(),
                5,
                Kind::KvStoreV4(dt, ps),
            );
        }
    }
    for ps in V4_PAGES {
        for layout in v4_page_layouts(ps) {
            let dt = DataType::from(layout);
            push(
                Op::CopyPages,
                r,
                format!("dsv4 P={ps} {}", layout.info().dtype),
                dt,
                24,
                Kind::CopyPages(layout, ps % 2 == 0),
            );
            push(
                Op::PageChecksums,
                r,
                format!("dsv4 P={ps} {}", layout.info().dtype),
                dt,
                24,
                Kind::PageChecksums(layout),
            );
        }
    }
    // DeepSeek-V4's top-k transform: k 512 (Flash) and 1024 (Pro) over the compressed
    // pool (page 64); rows of 0, 1, 63, 64, 65, k − 1, k, k + 1 and thousands of entries
    // (short rows take every position, even -inf and NaN ones).
    for d in V4Dims::ALL {
        let k = d.index_topk as u32;
        let mut lens = vec![0, 1, 63, 64, 65, k - 1, k, k + 1, 9000];
        if full {
            lens.push(65536 + 11);
        }
        for sc in [Scenario::Random, Scenario::Invalid, Scenario::ThresholdTies] {
            push(
                Op::Topk,
                r,
                format!("{} k={k} transform {sc:?}", d.name),
                DataType::Fp32,
                lens.len(),
                Kind::Topk(k as usize, d.csa_page, sc, lens.clone(), ShortRows::TakeAll),
            );
        }
    }
    for (name, shape) in v4_attention_shapes(full) {
        push(
            Op::SparseMlaV4,
            r,
            name,
            shape.main.dtype.into(),
            shape.tokens,
            Kind::SparseMlaV4(shape),
        );
    }
    // DeepSeek-V3.2's layouts at odd page sizes (every layout takes any P): stores, the
    // indexer and sparse MLA at the tiny dims with pages of 1 and 37 tokens.
    for dims in [TINY_P1, TINY_P37, DSV32_P37] {
        for dt in index_dtypes(&dims) {
            push(
                Op::IndexKStore,
                r,
                format!("{}{}", dims.name, scale_suffix(dt)),
                dt.into(),
                5,
                Kind::IndexKStore(dims, dt),
            );
            push(
                Op::IndexerLogits,
                r,
                format!("{} decode next_n=2{}", dims.name, scale_suffix(dt)),
                dt.into(),
                4,
                Kind::IndexerLogits(dims, dt, Form::Decode(2), vec![2, 38, 75, 300]),
            );
        }
        for dt in KV_DTYPES.into_iter().filter(|_| dims != DSV32_P37) {
            push(
                Op::KvStore,
                r,
                dims.name.to_string(),
                dt.into(),
                5,
                Kind::KvStore(dims, dt),
            );
            push(
                Op::SparseMla,
                r,
                format!("{} h_q=16", dims.name),
                dt.into(),
                6,
                Kind::SparseMla(dims, dt, 16, vec![1, 38, 90, 300]),
            );
        }
    }
    for dims in ModelDims::ALL {
        let dsv = dims == ModelDims::DSV32;
        for dt in index_dtypes(&dims) {
            push(
                Op::IndexKStore,
                r,
                format!("{}{}", dims.name, scale_suffix(dt)),
                dt.into(),
                5,
                Kind::IndexKStore(dims, dt),
            );
        }
        for dt in KV_DTYPES {
            push(
                Op::KvStore,
                r,
                dims.name.to_string(),
                dt.into(),
                5,
                Kind::KvStore(dims, dt),
            );
        }
        // Indexer: decode next_n 1 and 2, and prefill; contexts 1, page ± 1, 64K+.
        let ps = dims.page_size as u32;
        let long = 65536 + 37;
        let decode1: Vec<u32> = match (dsv, full) {
            (true, false) => vec![1, ps - 1, ps + 1, 700, 2049],
            _ => vec![1, ps - 1, ps, ps + 1, 4097, long, 70001],
        };
        let decode2: Vec<u32> = match (dsv, full) {
            (true, false) => vec![2, ps, 2 * ps + 1, 1500],
            _ => vec![2, ps, 2 * ps + 1, long + 64],
        };
        let prefill: Vec<u32> = match (dsv, full) {
            (true, false) => vec![5, ps, 301, 1000],
            _ => vec![5, ps, 1001, long],
        };
        for dt in index_dtypes(&dims) {
            for (form, lens) in [
                (Form::Decode(1), &decode1),
                (Form::Decode(2), &decode2),
                (Form::Prefill, &prefill),
            ] {
                let name = match form {
                    Form::Decode(n) => {
                        format!("{} decode next_n={n}{}", dims.name, scale_suffix(dt))
                    }
                    Form::Prefill => format!("{} prefill{}", dims.name, scale_suffix(dt)),
                };
                push(
                    Op::IndexerLogits,
                    r,
                    name,
                    dt.into(),
                    lens.len(),
                    Kind::IndexerLogits(dims, dt, form, lens.clone()),
                );
            }
        }
        // Top-k: short rows (padding), k ± 1, 64K+ (128K+ in full), adversarial ties.
        let k = dims.index_topk as u32;
        let mut lens = vec![1, k - 1, k, k + 1, 9000, long];
        if full {
            lens.push(131072 + 19);
        }
        for sc in [
            Scenario::Random,
            Scenario::AllEqual,
            Scenario::ThresholdTies,
            Scenario::Invalid,
        ] {
            push(
                Op::Topk,
                r,
                format!("{} k={k} {sc:?}", dims.name),
                DataType::Fp32,
                lens.len(),
                Kind::Topk(
                    k as usize,
                    dims.page_size,
                    sc,
                    lens.clone(),
                    ShortRows::SelectValid,
                ),
            );
        }
        // Sparse MLA.
        let heads: Vec<usize> = if full || !dsv {
            dims.q_heads.to_vec()
        } else {
            vec![16, 64]
        };
        let lens: Vec<u32> = if dsv {
            vec![1, ps + 1, 2100, 5000]
        } else {
            vec![1, ps + 1, 90, 300]
        };
        for dt in KV_DTYPES {
            for &h in &heads {
                push(
                    Op::SparseMla,
                    r,
                    format!("{} h_q={h}", dims.name),
                    dt.into(),
                    6,
                    Kind::SparseMla(dims, dt, h, lens.clone()),
                );
            }
        }
        for dt in KV_DTYPES {
            push(
                Op::SparseMla,
                r,
                format!("{} h_q=16 near-cancellation", dims.name),
                dt.into(),
                4,
                Kind::SparseMlaCancel(dims, dt),
            );
        }
        // Page copies (contiguous and page-first regions) and checksums, every layout.
        for layout in page_layouts(&dims) {
            let dt = DataType::from(layout);
            let kind = if matches!(layout, PageLayout::IndexK(_)) {
                "index_k"
            } else {
                "kv"
            };
            push(
                Op::CopyPages,
                r,
                format!("{} {kind}", dims.name),
                dt,
                24,
                Kind::CopyPages(layout, false),
            );
            push(
                Op::CopyPages,
                r,
                format!("{} {kind} page-first", dims.name),
                dt,
                24,
                Kind::CopyPages(layout, true),
            );
            push(
                Op::PageChecksums,
                r,
                format!("{} {kind}", dims.name),
                dt,
                24,
                Kind::PageChecksums(layout),
            );
        }
        // Batch invariance, one per op.
        for op in Op::ALL {
            push(
                op,
                Check::BatchInvariance,
                dims.name.to_string(),
                invariance_dtype(op),
                8,
                Kind::Invariance(dims, op),
            );
        }
    }
    cases
}

/// DeepSeek-V4 attention cases: V4-Flash (64 heads, window 128 at P 256 + compressed 512
/// at P 64, and the ratio-128 pool at P 2), V4-Pro (128 heads, compressed 1024), main only,
/// bf16_512 caches, odd heads and top-k; sinks none, finite and ±inf.
fn v4_attention_shapes(full: bool) -> Vec<(String, V4Shape)> {
    let c = |dtype, page_size, topk| V4CacheShape {
        dtype,
        page_size,
        topk,
    };
    let (m1, b16) = (KvDtype::Model1Fp8, KvDtype::Bf16x512);
    let d = V4Dims::FLASH;
    let tokens = if full { 9 } else { 6 };
    let mut v = vec![
        (
            "dsv4-flash csa h=64 sink",
            V4Shape {
                heads: 64,
                main: c(m1, d.window_page, d.window),
                extra: Some(c(m1, d.csa_page, d.index_topk)),
                sink: SinkKind::Finite,
                tokens,
            },
        ),
        (
            "dsv4-flash hca P=2 h=64 sink ±inf",
            V4Shape {
                heads: 64,
                main: c(m1, d.window_page, d.window),
                extra: Some(c(m1, d.hca_page, 96)),
                sink: SinkKind::Infinite,
                tokens,
            },
        ),
        (
            "dsv4-flash window only h=64",
            V4Shape {
                heads: 64,
                main: c(m1, d.window_page, d.window),
                extra: None,
                sink: SinkKind::None,
                tokens,
            },
        ),
        (
            "dsv4 bf16_512 h=16 sink",
            V4Shape {
                heads: 16,
                main: c(b16, 64, 128),
                extra: Some(c(b16, 2, 200)),
                sink: SinkKind::Finite,
                tokens,
            },
        ),
        (
            "dsv4 mixed h=3 topk 37+70",
            V4Shape {
                heads: 3,
                main: c(b16, 1, 37),
                extra: Some(c(m1, 37, 70)),
                sink: SinkKind::Infinite,
                tokens,
            },
        ),
        (
            "dsv4 h=33 P=1024",
            V4Shape {
                heads: 33,
                main: c(m1, 1024, 64),
                extra: Some(c(m1, 64, 130)),
                sink: SinkKind::None,
                tokens,
            },
        ),
    ];
    let p = V4Dims::PRO;
    v.push((
        "dsv4-pro csa h=128 sink",
        V4Shape {
            heads: p.q_heads,
            main: c(m1, p.window_page, p.window),
            extra: Some(c(m1, p.csa_page, p.index_topk)),
            sink: SinkKind::Finite,
            tokens: if full { 6 } else { 4 },
        },
    ));
    if full {
        v.push((
            "dsv4 h=1 topk 2048+2048",
            V4Shape {
                heads: 1,
                main: c(m1, 256, 2048),
                extra: Some(c(b16, 64, 2048)),
                sink: SinkKind::Finite,
                tokens: 5,
            },
        ));
    }
    v.into_iter().map(|(n, s)| (n.to_string(), s)).collect()
}

/// The dtype of an op's batch-invariance case.
fn invariance_dtype(op: Op) -> DataType {
    match op {
        Op::IndexKStore | Op::IndexerLogits | Op::CopyPages | Op::PageChecksums => {
            DataType::Fp8E4m3
        }
        Op::KvStore | Op::SparseMla => DataType::Fp8DsMla,
        Op::SparseMlaV4 => DataType::Model1Fp8,
        Op::Topk => DataType::Fp32,
    }
}
