//! The `params` of each op's golden files, one struct per op (unknown keys are errors: a
//! misspelt key must not default), and their mapping to the layout dtypes.

use serde::{Deserialize, Serialize};
use sparsekit_host::dtype::ScaleFormat;
use sparsekit_host::layout::{IndexKDtype, KvDtype};
use sparsekit_host::ops::Op;

use super::conventions::Conventions;
use super::{ExpectedFrom, GoldenError, Result};

#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub(super) enum IndexDt {
    #[serde(rename = "fp8_e4m3")]
    Fp8E4m3,
    #[serde(rename = "bf16")]
    Bf16,
    #[serde(rename = "fp4_e2m1")]
    Fp4E2m1,
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub(super) enum KvDt {
    #[serde(rename = "bf16")]
    Bf16,
    #[serde(rename = "fp8_ds_mla")]
    Fp8DsMla,
    #[serde(rename = "model1_fp8")]
    Model1Fp8,
    #[serde(rename = "bf16_512")]
    Bf16x512,
}

/// What a row no longer than `k` gets (`ShortRows`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum ShortRowsP {
    #[default]
    SelectValid,
    TakeAll,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum TopkOut {
    Positions,
    Slots,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct IndexKStoreParams {
    pub version: u32,
    pub dtype: IndexDt,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale: Option<ScaleFormat>,
    pub head_dim: usize,
    pub page_size: usize,
    #[serde(default, skip_serializing_if = "is_ours")]
    pub conventions: Conventions,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct KvStoreParams {
    pub version: u32,
    pub dtype: KvDt,
    pub nope_dim: usize,
    pub rope_dim: usize,
    pub page_size: usize,
    #[serde(default, skip_serializing_if = "is_ours")]
    pub conventions: Conventions,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct IndexerLogitsParams {
    pub version: u32,
    pub dtype: IndexDt,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale: Option<ScaleFormat>,
    pub head_dim: usize,
    pub page_size: usize,
    pub n_heads: usize,
    pub row_stride: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_n: Option<usize>,
    #[serde(default)]
    pub expected_from: ExpectedFrom,
    #[serde(default, skip_serializing_if = "is_ours")]
    pub conventions: Conventions,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct TopkParams {
    pub version: u32,
    pub k: usize,
    pub row_stride: usize,
    pub output: TopkOut,
    #[serde(default, skip_serializing_if = "is_select_valid")]
    pub short_rows: ShortRowsP,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page_size: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_n: Option<usize>,
    #[serde(default, skip_serializing_if = "is_ours")]
    pub conventions: Conventions,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SparseMlaParams {
    pub version: u32,
    pub dtype: KvDt,
    pub nope_dim: usize,
    pub rope_dim: usize,
    pub page_size: usize,
    pub n_heads: usize,
    pub topk: usize,
    pub softmax_scale: f64,
    #[serde(default)]
    pub expected_from: ExpectedFrom,
    #[serde(default, skip_serializing_if = "is_ours")]
    pub conventions: Conventions,
}

/// One cache of a `sparse_mla_v4` file (`model1_fp8` or `bf16_512`).
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct V4CacheP {
    pub dtype: KvDt,
    pub page_size: usize,
    pub topk: usize,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SparseMlaV4Params {
    pub version: u32,
    pub n_heads: usize,
    pub softmax_scale: f64,
    pub main: V4CacheP,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extra: Option<V4CacheP>,
    #[serde(default)]
    pub expected_from: ExpectedFrom,
    #[serde(default, skip_serializing_if = "is_ours")]
    pub conventions: Conventions,
}

fn is_ours(c: &Conventions) -> bool {
    *c == Conventions::default()
}

pub(super) fn index_dtype(dt: IndexDt, scale: Option<ScaleFormat>) -> Result<IndexKDtype, String> {
    match (dt, scale) {
        (IndexDt::Fp8E4m3, Some(scale)) => Ok(IndexKDtype::Fp8E4m3 { scale }),
        (IndexDt::Fp8E4m3, None) => {
            Err("scale (\"fp32\" or \"ue8m0\") is required for fp8_e4m3".into())
        }
        (IndexDt::Bf16, None) => Ok(IndexKDtype::Bf16),
        (IndexDt::Bf16, Some(_)) => Err("scale applies to fp8_e4m3 only".into()),
        (IndexDt::Fp4E2m1, None) => Ok(IndexKDtype::Fp4E2m1),
        (IndexDt::Fp4E2m1, Some(_)) => {
            Err("scale applies to fp8_e4m3 only (fp4_e2m1 scales are ue8m0 bytes)".into())
        }
    }
}

pub(super) fn index_dt(d: IndexKDtype) -> (IndexDt, Option<ScaleFormat>) {
    match d {
        IndexKDtype::Fp8E4m3 { scale } => (IndexDt::Fp8E4m3, Some(scale)),
        IndexKDtype::Bf16 => (IndexDt::Bf16, None),
        IndexKDtype::Fp4E2m1 => (IndexDt::Fp4E2m1, None),
    }
}

pub(super) fn kv_dtype(dt: KvDt) -> KvDtype {
    match dt {
        KvDt::Bf16 => KvDtype::Bf16,
        KvDt::Fp8DsMla => KvDtype::Fp8DsMla,
        KvDt::Model1Fp8 => KvDtype::Model1Fp8,
        KvDt::Bf16x512 => KvDtype::Bf16x512,
    }
}

pub(super) fn kv_dt(d: KvDtype) -> KvDt {
    match d {
        KvDtype::Bf16 => KvDt::Bf16,
        KvDtype::Fp8DsMla => KvDt::Fp8DsMla,
        KvDtype::Model1Fp8 => KvDt::Model1Fp8,
        KvDtype::Bf16x512 => KvDt::Bf16x512,
    }
}

fn is_select_valid(s: &ShortRowsP) -> bool {
    *s == ShortRowsP::SelectValid
}

/// The ops golden files cover.
const GOLDEN_OPS: [Op; 6] = [
    Op::IndexKStore,
    Op::KvStore,
    Op::IndexerLogits,
    Op::Topk,
    Op::SparseMla,
    Op::SparseMlaV4,
];

pub(super) fn op_by_name(name: &str) -> Result<Op> {
    GOLDEN_OPS
        .into_iter()
        .find(|o| o.name() == name)
        .ok_or_else(|| GoldenError::UnknownOp(name.to_string()))
}
