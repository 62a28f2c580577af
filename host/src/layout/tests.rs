//! Layout descriptor tests: pinned sizes, offsets and fingerprints.

use super::*;
use crate::dims::ModelDims;

fn dsv32_index(dtype: IndexKDtype) -> IndexKLayout {
    let d = ModelDims::DSV32;
    IndexKLayout::new(dtype, d.index_head_dim, d.page_size).unwrap()
}

#[test]
fn dsv32_index_k_sizes() {
    let fp8 = dsv32_index(IndexKDtype::FP8);
    assert_eq!(fp8.bytes_per_token(), 132);
    assert_eq!(fp8.bytes_per_page(), 8448);
    assert_eq!(fp8.value_range(1), 128..256);
    assert_eq!(fp8.scale_range(0), Some(8192..8196));
    assert_eq!(fp8.scale_range(63), Some(8444..8448));
    let bf16 = dsv32_index(IndexKDtype::Bf16);
    assert_eq!(bf16.bytes_per_token(), 256);
    assert_eq!(bf16.bytes_per_page(), 16384);
    assert_eq!(bf16.scale_range(5), None);
    assert_eq!(bf16.value_range(63), 16128..16384);
}

#[test]
fn slot_addresses_come_from_the_layout() {
    let fp8 = dsv32_index(IndexKDtype::FP8);
    // Slot 130 = page 2, offset 2.
    assert_eq!(fp8.slot_addr(130), SlotAddr { page: 2, offset: 2 });
    assert_eq!(SlotAddr { page: 2, offset: 2 }.slot(64), 130);
    assert_eq!(fp8.slot_value_bytes(130), 2 * 8448 + 256..2 * 8448 + 384);
    assert_eq!(
        fp8.slot_scale_bytes(130),
        Some(2 * 8448 + 8192 + 8..2 * 8448 + 8192 + 12)
    );
    let bf16 = dsv32_index(IndexKDtype::Bf16);
    assert_eq!(bf16.slot_value_bytes(65), 16384 + 256..16384 + 512);
    assert_eq!(bf16.slot_scale_bytes(65), None);
    let kv = KvLayout::new(KvDtype::Fp8DsMla, 512, 64, 64).unwrap();
    assert_eq!(kv.slot_token_bytes(65), 41984 + 656..41984 + 1312);
    assert_eq!(kv.page_bytes(3), 3 * 41984..4 * 41984);
    let pl: PageLayout = kv.into();
    assert_eq!(
        pl.slot_addr(127),
        SlotAddr {
            page: 1,
            offset: 63
        }
    );
}

#[test]
fn slot_runs_are_the_union_of_their_slots() {
    for dtype in [IndexKDtype::FP8, IndexKDtype::Bf16, IndexKDtype::Fp4E2m1] {
        for (d, ps) in [(128, 64), (128, 37), (128, 1), (256, 256)] {
            let l = IndexKLayout::new(dtype, d, ps).unwrap();
            for (slot, count) in [(0, 1), (3 * ps, ps), (2 * ps + ps / 2, ps - ps / 2)] {
                let (first, last) = (slot, slot + count - 1);
                let values = l.slot_value_bytes(first).start..l.slot_value_bytes(last).end;
                assert_eq!(
                    l.slot_run_value_bytes(slot, count),
                    values,
                    "{l:?} {slot}+{count}"
                );
                assert_eq!(values.len(), count * l.value_bytes_per_token());
                let scales = l.slot_scale_bytes(first).zip(l.slot_scale_bytes(last));
                assert_eq!(
                    l.slot_run_scale_bytes(slot, count),
                    scales.map(|(a, b)| a.start..b.end),
                    "{l:?} {slot}+{count}"
                );
            }
        }
    }
}

#[test]
fn dsv32_kv_sizes() {
    let bf16 = KvLayout::new(KvDtype::Bf16, 512, 64, 64).unwrap();
    assert_eq!(bf16.bytes_per_token(), 1152);
    assert_eq!(bf16.bytes_per_page(), 73728);
    assert_eq!(bf16.rope_range(), 1024..1152);
    let fp8 = KvLayout::new(KvDtype::Fp8DsMla, 512, 64, 64).unwrap();
    assert_eq!(fp8.bytes_per_token(), 656);
    assert_eq!(fp8.bytes_per_page(), 41984);
    assert_eq!(fp8.nope_range(), 0..512);
    assert_eq!(fp8.scales_range(), 512..528);
    assert_eq!(fp8.rope_range(), 528..656);
    assert_eq!(fp8.token_range(2), 1312..1968);
}

#[test]
fn fingerprints_distinguish_descriptors_and_are_stable() {
    let a = dsv32_index(IndexKDtype::FP8);
    let b = dsv32_index(IndexKDtype::Bf16);
    let c = dsv32_index(IndexKDtype::Fp8E4m3 {
        scale: ScaleFormat::Ue8m0,
    });
    let d = IndexKLayout::new(IndexKDtype::FP8, 128, 32).unwrap();
    let all = [
        a.fingerprint(),
        b.fingerprint(),
        c.fingerprint(),
        d.fingerprint(),
    ];
    for i in 0..all.len() {
        for j in i + 1..all.len() {
            assert_ne!(all[i], all[j]);
        }
    }
    assert_eq!(a.fingerprint(), dsv32_index(IndexKDtype::FP8).fingerprint());
    let kv1 = KvLayout::new(KvDtype::Bf16, 512, 64, 64).unwrap();
    let kv2 = KvLayout::new(KvDtype::Fp8DsMla, 512, 64, 64).unwrap();
    assert_ne!(kv1.fingerprint(), kv2.fingerprint());
    // Pinned value: a change here breaks every stored frame and cache; bump the domain
    // string's version instead of editing this constant.
    assert_eq!(a.fingerprint(), 0xb9d7_14fa_e865_25da);
    assert_eq!(kv2.fingerprint(), 0xba53_50e3_c68d_7f4b);
}

#[test]
fn invalid_layouts_are_errors() {
    assert!(matches!(
        IndexKLayout::new(IndexKDtype::Bf16, 100, 64),
        Err(Error::InvalidLayout(_))
    ));
    assert!(matches!(
        IndexKLayout::new(IndexKDtype::Bf16, 128, 0),
        Err(Error::InvalidLayout(_))
    ));
    assert!(matches!(
        KvLayout::new(KvDtype::Fp8DsMla, 320, 64, 64),
        Err(Error::InvalidLayout(_))
    ));
    assert!(matches!(
        KvLayout::new(KvDtype::Bf16, 512, 0, 64),
        Err(Error::InvalidLayout(_))
    ));
    // Pages above 4 GiB (the kernels' u32 in-page offsets) are refused, never
    // truncated; the product itself never overflows.
    for (head_dim, page_size) in [(1 << 20, 4096), (usize::MAX / 16 * 16, 64)] {
        for dt in [IndexKDtype::FP8, IndexKDtype::Bf16] {
            assert!(
                matches!(
                    IndexKLayout::new(dt, head_dim, page_size),
                    Err(Error::InvalidLayout(_))
                ),
                "{head_dim} × {page_size}"
            );
        }
    }
    assert!(IndexKLayout::new(IndexKDtype::Bf16, (1 << 19) - 16, 4096).is_ok());
    assert!(IndexKLayout::new(IndexKDtype::Bf16, 1 << 19, 4096).is_err());
    assert!(IndexKLayout::new(IndexKDtype::FP8, 1 << 19, 4096).is_ok());
    assert!(matches!(
        KvLayout::new(KvDtype::Bf16, 1 << 20, 16, 4096),
        Err(Error::InvalidLayout(_))
    ));
    assert!(matches!(
        KvLayout::new(KvDtype::Fp8DsMla, usize::MAX / 128 * 128, 16, 1),
        Err(Error::InvalidLayout(_))
    ));
    let l = IndexKLayout::new(IndexKDtype::FP8, 128, 64).unwrap();
    assert_eq!(l.pages_in("x", 8448 * 3).unwrap(), 3);
    assert!(matches!(
        l.pages_in("x", 8448 * 3 + 1),
        Err(Error::BufferSize { .. })
    ));
}

#[test]
fn model1_fp8_pages_are_rows_then_scales_padded_to_rows() {
    for (p, stride) in [
        (64, 37440),
        (256, 149760),
        (2, 1728),
        (1, 1152),
        (63, 36864),
    ] {
        let l = KvLayout::model1_fp8(p).unwrap();
        assert_eq!(l.bytes_per_token(), 584);
        assert_eq!(l.row_bytes(), 576);
        assert_eq!(l.bytes_per_page(), stride, "P = {p}");
        assert_eq!(l.bytes_per_page() % 576, 0);
        assert!(l.bytes_per_page() >= 584 * p && l.bytes_per_page() < 584 * p + 576);
        assert_eq!(l.scale_section_offset(), Some(576 * p));
        assert_eq!(l.tiles_per_token(), 7);
        assert_eq!(l.d_v(), 512);
        let last = p - 1;
        assert_eq!(l.token_range(last), 576 * last..576 * p);
        assert_eq!(l.nope_range(), 0..448);
        assert_eq!(l.rope_range(), 448..576);
        assert_eq!(
            l.tile_scale_range(last),
            576 * p + 8 * last..576 * p + 8 * last + 7
        );
        // The last scale's pad byte still lies inside the page.
        assert!(576 * p + 8 * p <= l.bytes_per_page());
    }
    let l = KvLayout::model1_fp8(64).unwrap();
    assert_eq!(l.slot_token_bytes(65), 37440 + 576..37440 + 1152);
    assert_eq!(
        l.slot_tile_scale_bytes(65),
        37440 + 36864 + 8..37440 + 36864 + 15
    );
}

#[test]
fn bf16_512_and_fp4_sizes() {
    let b = KvLayout::bf16_512(256).unwrap();
    assert_eq!(b.bytes_per_token(), 1024);
    assert_eq!(b.bytes_per_page(), 256 * 1024);
    assert_eq!(b.d_v(), 512);
    assert_eq!(b.rope_range(), 896..1024);
    assert_eq!(b.tile_scale_range(3), 3968..3968);
    let f = IndexKLayout::new(IndexKDtype::Fp4E2m1, 128, 64).unwrap();
    assert_eq!(f.bytes_per_token(), 68);
    assert_eq!(f.value_bytes_per_token(), 64);
    assert_eq!(f.bytes_per_page(), 68 * 64);
    assert_eq!(f.scale_section_offset(), Some(4096));
    assert_eq!(f.value_range(2), 128..192);
    assert_eq!(f.scale_range(2), Some(4104..4108));
    assert_eq!(
        f.slot_scale_bytes(65),
        Some(4352 + 4096 + 4..4352 + 4096 + 8)
    );
    assert!(IndexKLayout::new(IndexKDtype::Fp4E2m1, 96, 64).is_err());
    assert!(IndexKLayout::new(IndexKDtype::Fp4E2m1, 64, 1).is_err());
    assert!(IndexKLayout::new(IndexKDtype::Fp4E2m1, 256, 1).is_ok());
}

#[test]
fn every_layout_takes_every_page_size_up_to_1024() {
    let index = [
        IndexKDtype::FP8,
        IndexKDtype::Bf16,
        IndexKDtype::Fp4E2m1,
        IndexKDtype::Fp8E4m3 {
            scale: ScaleFormat::Ue8m0,
        },
    ];
    for p in 1..=1024 {
        for dt in index {
            let l = IndexKLayout::new(dt, 128, p).unwrap();
            assert_eq!(l.bytes_per_page(), l.bytes_per_token() * p);
            let end = l
                .scale_range(p - 1)
                .map_or(l.value_range(p - 1).end, |r| r.end);
            assert_eq!(end, l.bytes_per_page());
        }
        for l in [
            KvLayout::new(KvDtype::Bf16, 512, 64, p).unwrap(),
            KvLayout::new(KvDtype::Fp8DsMla, 512, 64, p).unwrap(),
            KvLayout::model1_fp8(p).unwrap(),
            KvLayout::bf16_512(p).unwrap(),
        ] {
            assert!(l.token_range(p - 1).end <= l.bytes_per_page());
            assert!(l.tile_scale_range(p - 1).end <= l.bytes_per_page());
        }
    }
}

#[test]
fn v4_layouts_have_fixed_dims_and_their_own_fingerprints() {
    assert!(KvLayout::new(KvDtype::Model1Fp8, 512, 64, 64).is_err());
    assert!(KvLayout::new(KvDtype::Bf16x512, 448, 32, 64).is_err());
    let m = KvLayout::model1_fp8(64).unwrap();
    let b = KvLayout::bf16_512(64).unwrap();
    let v3 = KvLayout::new(KvDtype::Bf16, 448, 64, 64).unwrap();
    assert_eq!(b.bytes_per_page(), v3.bytes_per_page());
    let f = IndexKLayout::new(IndexKDtype::Fp4E2m1, 128, 64).unwrap();
    let fps = [m.fingerprint(), b.fingerprint(), v3.fingerprint()];
    assert!(fps[0] != fps[1] && fps[1] != fps[2] && fps[0] != fps[2]);
    assert_ne!(f.fingerprint(), dsv32_index(IndexKDtype::FP8).fingerprint());
    assert_ne!(
        m.fingerprint(),
        KvLayout::model1_fp8(256).unwrap().fingerprint()
    );
}

/// `entry_spans(n)` holds exactly the bytes of entries `0..n` (each entry's row, values
/// and scales, the model1 pad byte included) for every layout and several page sizes:
/// as many bytes as `n` entries have, every entry byte inside, ranges ascending and
/// disjoint; a model1 or scaled index-K page is two ranges (rows, then the scale section).
#[test]
fn entry_spans_hold_exactly_the_first_entries() {
    let index = [IndexKDtype::FP8, IndexKDtype::Bf16, IndexKDtype::Fp4E2m1];
    for p in [1usize, 2, 3, 64, 255, 256] {
        let mut layouts: Vec<PageLayout> = index
            .iter()
            .map(|&dt| IndexKLayout::new(dt, 128, p).unwrap().into())
            .collect();
        for l in [
            KvLayout::new(KvDtype::Bf16, 512, 64, p).unwrap(),
            KvLayout::new(KvDtype::Fp8DsMla, 512, 64, p).unwrap(),
            KvLayout::model1_fp8(p).unwrap(),
            KvLayout::bf16_512(p).unwrap(),
        ] {
            layouts.push(l.into());
        }
        for l in layouts {
            let per_entry = match l {
                PageLayout::Kv(k) => k.bytes_per_token(),
                PageLayout::IndexK(i) => i.bytes_per_token(),
            };
            assert!(l.entry_spans(0).is_empty());
            for n in [1, p / 2, p.saturating_sub(1), p, p + 5] {
                if n == 0 {
                    continue;
                }
                let spans = l.entry_spans(n);
                let m = n.min(p);
                let total: usize = spans.iter().map(|r| r.len()).sum();
                assert_eq!(total, m * per_entry, "{:?} n {n}", l.info());
                assert!(spans.windows(2).all(|w| w[0].end <= w[1].start));
                assert!(spans.last().unwrap().end <= l.bytes_per_page());
                let inside = |r: std::ops::Range<usize>| {
                    r.is_empty() || spans.iter().any(|s| s.start <= r.start && r.end <= s.end)
                };
                for e in 0..m {
                    match l {
                        PageLayout::Kv(k) => {
                            assert!(inside(k.token_range(e)));
                            assert!(inside(k.tile_scale_range(e)));
                        }
                        PageLayout::IndexK(i) => {
                            assert!(inside(i.value_range(e)));
                            assert!(i.scale_range(e).is_none_or(inside));
                        }
                    }
                }
                let two = matches!(l, PageLayout::Kv(k) if k.dtype() == KvDtype::Model1Fp8)
                    || matches!(l, PageLayout::IndexK(i) if i.dtype() != IndexKDtype::Bf16);
                assert_eq!(spans.len(), if two { 2 } else { 1 });
            }
        }
    }
}
