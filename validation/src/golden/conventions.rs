//! The conventions of dumps from other deployments, where they differ from ours: a file
//! states them in `params.conventions` (every key optional, the default is ours), and
//! `check` judges the file under them — the user never edits a tensor. `docs/golden.md`
//! lists every key with the deployments that use it.

use serde::{Deserialize, Serialize};
use sparsekit_host::ops::Op;

pub use crate::reference::Division;
use crate::reference::QuantRules;

/// `params.conventions` (see the module docs). Unknown keys are errors; a key that does
/// not apply to the file's op is an error too.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Conventions {
    /// Stores, fp8: how the scale divides the amax by 448 (`divide`, ours;
    /// `reciprocal`: `amax * f32(1/448)`, DeepSeek-V3.2's and SGLang's index-K scale).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale: Option<Division>,
    /// Stores, fp8: how values are divided by their scale before the e4m3 cast (`divide`,
    /// ours; `reciprocal`: `x * (1/s)`, DeepGEMM's `kv_cache_cast_to_fp8`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantize: Option<Division>,
    /// indexer_logits: how the expected logits dequantised fp8 keys (`exact`, ours;
    /// `bf16`: `e4m3 · scale` rounded to bf16 before the dot products, as DeepGEMM's
    /// reference does).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_dequant: Option<KeyDequant>,
    /// topk: what fills a row with fewer than `k` valid logits (`minus_one`, ours;
    /// `masked_positions`: positions whose logit is masked, as a plain `torch.topk` over
    /// a masked row lists them — DeepSeek-V3.2 prefill).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topk_padding: Option<TopkPadding>,
    /// sparse_mla: the lse of a token with no valid slot (`-inf`, ours; `+inf`, FlashMLA).
    /// sparse_mla_v4: ours is FlashMLA's `+inf`; `-inf` states a dump that writes `-inf`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub empty_lse: Option<EmptyLse>,
    /// sparse_mla: the layout of `lse` (`tokens_heads`, ours `[n_tokens, n_heads]`;
    /// `batch_heads_seq`, FlashMLA decode `[batch, n_heads, s_q]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lse_layout: Option<LseLayout>,
    /// sparse_mla: which indices are invalid (`minus_one`, ours: any other index outside
    /// the cache is an error; `out_of_range`, FlashMLA: every negative index and every
    /// index at or past the cache's end is skipped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub invalid_indices: Option<InvalidIndices>,
}

/// See [`Conventions::key_dequant`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyDequant {
    #[default]
    Exact,
    Bf16,
}

/// See [`Conventions::topk_padding`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TopkPadding {
    #[default]
    MinusOne,
    MaskedPositions,
}

/// See [`Conventions::empty_lse`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum EmptyLse {
    #[default]
    #[serde(rename = "-inf")]
    NegInf,
    #[serde(rename = "+inf")]
    PosInf,
}

/// See [`Conventions::lse_layout`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LseLayout {
    #[default]
    TokensHeads,
    BatchHeadsSeq,
}

/// See [`Conventions::invalid_indices`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InvalidIndices {
    #[default]
    MinusOne,
    OutOfRange,
}

impl Conventions {
    /// Checks that every key set applies to `op`.
    pub fn check_applies(&self, op: Op) -> Result<(), String> {
        let set: [(&str, bool, &[Op]); 7] = [
            (
                "scale",
                self.scale.is_some(),
                &[Op::IndexKStore, Op::KvStore],
            ),
            (
                "quantize",
                self.quantize.is_some(),
                &[Op::IndexKStore, Op::KvStore],
            ),
            (
                "key_dequant",
                self.key_dequant.is_some(),
                &[Op::IndexerLogits],
            ),
            ("topk_padding", self.topk_padding.is_some(), &[Op::Topk]),
            (
                "empty_lse",
                self.empty_lse.is_some(),
                &[Op::SparseMla, Op::SparseMlaV4],
            ),
            (
                "lse_layout",
                self.lse_layout.is_some(),
                &[Op::SparseMla, Op::SparseMlaV4],
            ),
            (
                "invalid_indices",
                self.invalid_indices.is_some(),
                &[Op::SparseMla],
            ),
        ];
        match set
            .iter()
            .find(|(_, is_set, ops)| *is_set && !ops.contains(&op))
        {
            Some((key, _, ops)) => Err(format!(
                "conventions.{key} applies to {} only",
                ops.iter().map(|o| o.name()).collect::<Vec<_>>().join(", ")
            )),
            None => Ok(()),
        }
    }

    /// The quantiser rules of a store file.
    pub fn quant_rules(&self) -> QuantRules {
        QuantRules {
            scale: self.scale.unwrap_or_default(),
            values: self.quantize.unwrap_or_default(),
        }
    }

    /// The conventions set, in words (for the report's notes); empty when all are ours.
    pub fn describe(&self) -> Vec<String> {
        let v = serde_json::to_value(self).unwrap_or_default();
        v.as_object()
            .map(|o| o.iter().map(|(k, v)| format!("{k} = {v}")).collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_parse_and_apply_to_their_ops_only() {
        let c: Conventions =
            serde_json::from_str(r#"{"empty_lse": "+inf", "lse_layout": "batch_heads_seq"}"#)
                .unwrap_or_default();
        assert_eq!(c.empty_lse, Some(EmptyLse::PosInf));
        assert!(c.check_applies(Op::SparseMla).is_ok());
        assert!(c.check_applies(Op::Topk).is_err());
        assert_eq!(c.describe().len(), 2);
        assert!(serde_json::from_str::<Conventions>(r#"{"emptylse": "+inf"}"#).is_err());
        assert!(serde_json::from_str::<Conventions>(r#"{"scale": "multiply"}"#).is_err());
        let s: Conventions = serde_json::from_str(r#"{"scale": "reciprocal"}"#).unwrap_or_default();
        assert_eq!(s.quant_rules().scale, Division::Reciprocal);
        assert_eq!(s.quant_rules().values, Division::Divide);
        assert!(Conventions::default().describe().is_empty());
    }
}
