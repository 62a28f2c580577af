//! Bit-exact cross-check of the fp8 e4m3fn codec and the quantization scales against
//! NumPy + ml_dtypes (`validation/python/e4m3_vectors.py`).
//!
//! Needs `python3` with the packages of `validation/python/requirements.txt` (`.ci/run`
//! installs them). Without them the test says so and passes, unless
//! `SPARSEKIT_REQUIRE_PYTHON=1` (set by `.ci/run`), where it fails.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use std::io::Write as _;
use std::path::Path;
use std::process::Command;

use half::bf16;
use serde_json::Value;
use sparsekit_host::cpu::store::{write_index_k_token, write_kv_token};
use sparsekit_host::dtype::{e4m3_decode, e4m3_encode, ScaleFormat};
use sparsekit_host::layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout};

fn vectors() -> Option<Value> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../validation/python/e4m3_vectors.py");
    let required = std::env::var("SPARSEKIT_REQUIRE_PYTHON").is_ok_and(|v| v == "1");
    let out = Command::new("python3").arg(&script).output();
    match out {
        Ok(o) if o.status.success() => {
            Some(serde_json::from_slice(&o.stdout).expect("script prints JSON"))
        }
        Ok(o) => {
            let msg = String::from_utf8_lossy(&o.stderr).to_string();
            assert!(!required, "e4m3_vectors.py failed: {msg}");
            let _ = writeln!(std::io::stderr(), "SKIPPED ml_dtypes cross-check (pip install -r validation/python/requirements.txt): {msg}");
            None
        }
        Err(e) => {
            assert!(!required, "python3 not runnable: {e}");
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED ml_dtypes cross-check: python3 not runnable: {e}"
            );
            None
        }
    }
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("integer"))
        .collect()
}

#[test]
fn e4m3_and_scales_match_ml_dtypes_bit_exactly() {
    let Some(v) = vectors() else { return };
    let seed = v["seed"].as_u64().unwrap_or(0);
    // All 256 codes decode to the same f32 bits (NaNs: both NaN).
    let decode = v["decode"].as_array().expect("decode");
    assert_eq!(decode.len(), 256);
    for pair in decode {
        let p = u64s(pair);
        let ours = e4m3_decode(p[0] as u8);
        let theirs = f32::from_bits(p[1] as u32);
        assert!(
            ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()),
            "decode {:#04x}: ours {ours} ml_dtypes {theirs}",
            p[0]
        );
    }
    // Encoding of random, subnormal, tie, boundary, NaN and inf values.
    let encode = v["encode"].as_array().expect("encode");
    assert!(encode.len() > 3000);
    for pair in encode {
        let p = u64s(pair);
        let x = f32::from_bits(p[0] as u32);
        let theirs = p[1] as u8;
        let ours = e4m3_encode(x);
        if x.is_nan() {
            assert_eq!(ours & 0x7f, 0x7f, "NaN must stay NaN");
            assert_eq!(theirs & 0x7f, 0x7f);
        } else {
            assert_eq!(ours, theirs, "encode {x:e} ({:#010x}), seed {seed}", p[0]);
        }
    }
    // Per-token index-K quantization (values and f32 scale), both scale formats.
    for fmt in [ScaleFormat::Fp32, ScaleFormat::Ue8m0] {
        let layout =
            IndexKLayout::new(IndexKDtype::Fp8E4m3 { scale: fmt }, 128, 1).expect("layout");
        let name = if fmt == ScaleFormat::Fp32 {
            "fp32"
        } else {
            "ue8m0"
        };
        let cases: Vec<&Value> = v["index_k"]
            .as_array()
            .expect("index_k")
            .iter()
            .filter(|c| c[1] == name)
            .collect();
        assert!(!cases.is_empty());
        for c in cases {
            let key: Vec<bf16> = u64s(&c[0])
                .iter()
                .map(|&b| bf16::from_bits(b as u16))
                .collect();
            let mut page = vec![0u8; layout.bytes_per_page()];
            write_index_k_token(&layout, &mut page, 0, &key);
            let codes: Vec<u8> = u64s(&c[2]).iter().map(|&b| b as u8).collect();
            assert_eq!(
                &page[..128],
                &codes[..],
                "index-K codes ({name}), seed {seed}"
            );
            let scale = u32::from_le_bytes(page[128..132].try_into().expect("4 bytes"));
            assert_eq!(
                scale as u64,
                c[3].as_u64().expect("scale"),
                "index-K scale ({name}), seed {seed}"
            );
        }
    }
    // fp8_ds_mla tiles: one tile of 128 + scale (rope omitted: 16 zero rope values).
    let layout = KvLayout::new(KvDtype::Fp8DsMla, 128, 16, 1).expect("layout");
    for c in v["kv_tiles"].as_array().expect("kv_tiles") {
        let mut tok: Vec<bf16> = u64s(&c[0])
            .iter()
            .map(|&b| bf16::from_bits(b as u16))
            .collect();
        tok.extend(std::iter::repeat_n(bf16::ONE, 16));
        let mut bytes = vec![0u8; layout.bytes_per_page()];
        write_kv_token(&layout, &mut bytes, 0, &tok);
        let codes: Vec<u8> = u64s(&c[1]).iter().map(|&b| b as u8).collect();
        assert_eq!(&bytes[..128], &codes[..], "kv tile codes, seed {seed}");
        let scale = u32::from_le_bytes(bytes[128..132].try_into().expect("4 bytes"));
        assert_eq!(
            scale as u64,
            c[2].as_u64().expect("scale"),
            "kv tile scale, seed {seed}"
        );
    }
    // DeepSeek-V4 MODEL1 tokens: 7 tiles of 64 e4m3 codes, 7 ue8m0 scale bytes + a zero pad
    // in the page's scale section.
    let layout = KvLayout::model1_fp8(1).expect("layout");
    for c in v["model1"].as_array().expect("model1") {
        let mut tok: Vec<bf16> = u64s(&c[0])
            .iter()
            .map(|&b| bf16::from_bits(b as u16))
            .collect();
        tok.extend(std::iter::repeat_n(bf16::ONE, 64));
        let mut page = vec![0x5au8; layout.bytes_per_page()];
        write_kv_token(&layout, &mut page, 0, &tok);
        let codes: Vec<u8> = u64s(&c[1]).iter().map(|&b| b as u8).collect();
        assert_eq!(&page[..448], &codes[..], "model1 codes, seed {seed}");
        let mut scales: Vec<u8> = u64s(&c[2]).iter().map(|&b| b as u8).collect();
        scales.push(0);
        assert_eq!(
            &page[layout.tile_scale_range(0).start..][..8],
            &scales[..],
            "model1 scales, seed {seed}"
        );
    }
    // fp4 index keys: four groups of 32 (packed e2m1, even element low) and their ue8m0
    // bytes.
    let layout = IndexKLayout::new(IndexKDtype::Fp4E2m1, 128, 1).expect("layout");
    for c in v["fp4"].as_array().expect("fp4") {
        let key: Vec<bf16> = u64s(&c[0])
            .iter()
            .map(|&b| bf16::from_bits(b as u16))
            .collect();
        let mut page = vec![0x5au8; layout.bytes_per_page()];
        write_index_k_token(&layout, &mut page, 0, &key);
        let packed: Vec<u8> = u64s(&c[1]).iter().map(|&b| b as u8).collect();
        let scales: Vec<u8> = u64s(&c[2]).iter().map(|&b| b as u8).collect();
        assert_eq!(&page[..64], &packed[..], "fp4 codes, seed {seed}");
        assert_eq!(&page[64..68], &scales[..], "fp4 scales, seed {seed}");
    }
}
