//! `index_k_store` and `kv_store`: new tokens into their cache pages.

use super::{check_count, check_size, check_slots};
use crate::error::Result;
use crate::layout::{IndexKLayout, KvLayout};

/// `index_k_store`: quantize (fp8) or copy (bf16) `slots.len()` bf16 keys into a paged
/// index-K buffer at the given slots (`-1` = skip). A key holding ±inf gets scale `inf`
/// and reads back as NaN (see [`crate::dtype`]).
#[derive(Clone, Copy, Debug)]
pub struct IndexKStore<'a> {
    pub layout: IndexKLayout,
    pub slots: &'a [i64],
}

impl IndexKStore<'_> {
    /// Validates the call; returns the number of pages in the cache.
    pub fn validate(&self, keys_bytes: usize, cache_bytes: usize) -> Result<usize> {
        check_count("slots", self.slots.len())?;
        check_size(
            "keys",
            &[self.slots.len(), self.layout.head_dim(), 2],
            keys_bytes,
        )?;
        let pages = self.layout.pages_in("index-K cache", cache_bytes)?;
        check_slots("slots", self.slots, pages * self.layout.page_size())?;
        Ok(pages)
    }
}

/// `kv_store`: store `slots.len()` bf16 tokens (`[latent | rope]`) into a paged KV buffer.
/// An fp8_ds_mla tile holding ±inf gets scale `inf` and reads back as NaN (see
/// [`crate::dtype`]).
#[derive(Clone, Copy, Debug)]
pub struct KvStore<'a> {
    pub layout: KvLayout,
    pub slots: &'a [i64],
}

impl KvStore<'_> {
    /// Validates the call; returns the number of pages in the cache.
    pub fn validate(&self, kv_bytes: usize, cache_bytes: usize) -> Result<usize> {
        check_count("slots", self.slots.len())?;
        check_size("kv", &[self.slots.len(), self.layout.d_qk(), 2], kv_bytes)?;
        let pages = self.layout.pages_in("KV cache", cache_bytes)?;
        check_slots("slots", self.slots, pages * self.layout.page_size())?;
        Ok(pages)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Backend;
    use crate::cpu::CpuBackend;
    use crate::dtype::{bf16, e4m3_decode};
    use crate::layout::{IndexKDtype, KvDtype};

    /// The documented store of ±inf: scale inf, finite values to code ±0, ±inf to NaN,
    /// every value NaN when read back; NaN alone stores its own code only.
    #[test]
    fn infinite_values_make_the_scale_infinite() {
        let b = CpuBackend::new();
        let l = IndexKLayout::new(IndexKDtype::FP8, 16, 4).unwrap();
        let mut keys = vec![bf16::from_f32(0.5); 32];
        keys[3] = bf16::INFINITY;
        keys[16 + 5] = bf16::NAN;
        let mut cache = b.upload(&vec![0x33u8; l.buffer_bytes(1)]).unwrap();
        let op = IndexKStore {
            layout: l,
            slots: &[0, 1],
        };
        b.index_k_store(
            &op,
            &b.upload(bytemuck::cast_slice(&keys)).unwrap(),
            &mut cache,
        )
        .unwrap();
        let c = b.download(&cache).unwrap();
        let scale = |s: usize| {
            let r = l.slot_scale_bytes(s).unwrap();
            f32::from_le_bytes([c[r.start], c[r.start + 1], c[r.start + 2], c[r.start + 3]])
        };
        assert_eq!(scale(0), f32::INFINITY);
        let codes = &c[l.slot_value_bytes(0)];
        // inf / inf: a NaN code (its sign is the platform's: x86 sets it, GPUs do not).
        assert_eq!(codes[3] & 0x7f, 0x7f);
        assert!(codes.iter().enumerate().all(|(i, &x)| i == 3 || x == 0));
        assert!(codes.iter().all(|&x| (e4m3_decode(x) * scale(0)).is_nan()));
        // NaN: ignored by the amax (scale 0.5 / 448), its own code NaN.
        assert_eq!(scale(1), 0.5 / 448.0);
        let codes = &c[l.slot_value_bytes(1)];
        assert_eq!(codes[5], 0x7f);
        assert!(codes.iter().enumerate().all(|(i, &x)| i == 5 || x == 0x7e));

        let kl = KvLayout::new(KvDtype::Fp8DsMla, 256, 16, 4).unwrap();
        let mut kv = vec![bf16::from_f32(0.25); 272];
        kv[130] = bf16::NEG_INFINITY; // tile 1
        let mut cache = b.upload(&vec![0u8; kl.buffer_bytes(1)]).unwrap();
        b.kv_store(
            &KvStore {
                layout: kl,
                slots: &[2],
            },
            &b.upload(bytemuck::cast_slice(&kv)).unwrap(),
            &mut cache,
        )
        .unwrap();
        let c = b.download(&cache).unwrap();
        let tok = &c[kl.slot_token_bytes(2)];
        let sc = kl.scales_range();
        let tile_scale = |t: usize| {
            let at = sc.start + 4 * t;
            f32::from_le_bytes([tok[at], tok[at + 1], tok[at + 2], tok[at + 3]])
        };
        assert!(tile_scale(0).is_finite());
        assert_eq!(tile_scale(1), f32::INFINITY);
        assert_eq!(tok[130] & 0x7f, 0x7f, "-inf / inf: a NaN code");
        assert!(tok[128..256]
            .iter()
            .enumerate()
            .all(|(i, &x)| i == 2 || x == 0));
    }
}
