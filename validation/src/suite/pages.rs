//! `copy_pages` and `page_checksums` cases: contiguous and page-first regions (as in a
//! multi-layer host pool), garbage bytes, random and repeated ids.

use rand::seq::SliceRandom;
use rand::Rng;
use sparsekit_host::layout::{IndexKDtype, IndexKLayout, PageLayout};
use sparsekit_host::ops::{CopyPages, Op, PageChecksums, PagedRegion};
use sparsekit_host::{Backend, Error};

use super::record::Outcome;
use crate::fixtures::{self, region, region_bytes, SuiteRng};
use crate::reference;
use crate::tolerance::{self, compare_bytes, DataType, ErrorStats, Quantity};

/// One `copy_pages` case.
pub(super) fn copy_pages<B: Backend>(
    b: &B,
    rng: &mut SuiteRng,
    layout: PageLayout,
    page_first: bool,
) -> Result<Outcome, Error> {
    let extra = if page_first {
        3 * 16 + layout.bytes_per_page() / 3 / 16 * 16
    } else {
        0
    };
    let (np_src, np_dst, n) = (37, 29, 24);
    let src_r = region(layout, np_src, page_first, extra);
    let dst_r = region(layout, np_dst, !page_first, extra + 16);
    let src = fixtures::garbage(rng, region_bytes(&src_r));
    let dst0 = fixtures::garbage(rng, region_bytes(&dst_r));
    let src_ids: Vec<i32> = (0..n).map(|_| rng.gen_range(0..np_src as i32)).collect();
    let mut dst_ids: Vec<i32> = (0..np_dst as i32).collect();
    dst_ids.shuffle(rng);
    dst_ids.truncate(n);
    let op = CopyPages {
        src: src_r,
        dst: dst_r,
        src_ids: &src_ids,
        dst_ids: &dst_ids,
    };
    let mut dst = b.upload(&dst0)?;
    b.copy_pages(&op, &b.upload(&src)?, &mut dst)?;
    let got = b.download(&dst)?;
    let mut want = dst0.clone();
    reference::copy_pages(&src_r, &dst_r, &src, &mut want, &src_ids, &dst_ids);
    let t = tolerance::get(Op::CopyPages, Quantity::Pages, DataType::Bytes)?;
    let mut stats = ErrorStats::default();
    compare_bytes(&mut stats, &got, &want);
    stats.count += got.len();
    let mut o = Outcome::new(Quantity::Pages, stats, t);
    o.note = format!(
        "{n} pages, {} B/page, src stride {} dst stride {}",
        layout.bytes_per_page(),
        src_r.stride,
        dst_r.stride
    );
    Ok(o)
}

/// One `page_checksums` case.
pub(super) fn page_checksums<B: Backend>(
    b: &B,
    rng: &mut SuiteRng,
    layout: PageLayout,
) -> Result<Outcome, Error> {
    let t = tolerance::get(Op::PageChecksums, Quantity::Checksums, DataType::U64)?;
    let mut stats = ErrorStats::default();
    // Pages 16-byte aligned (the GPU kernels' vector path), pages 4 mod 16 (their byte
    // path), and a 60-byte page (16-byte pieces, then a whole and a partial word).
    let odd = IndexKLayout::new(IndexKDtype::FP8, 16, 3)?.into();
    let odd_region = PagedRegion {
        layout: odd,
        offset: 16,
        stride: 64,
        num_pages: 31,
    };
    for r in [
        region(layout, 31, true, 48),
        region(layout, 31, true, 4),
        odd_region,
    ] {
        let pool = fixtures::garbage(rng, region_bytes(&r));
        let ids: Vec<i32> = (0..24).map(|_| rng.gen_range(0..31)).collect();
        let op = PageChecksums {
            region: r,
            ids: &ids,
        };
        let mut out = b.upload(&fixtures::poison_f32(ids.len() * 2))?;
        b.page_checksums(&op, &b.upload(&pool)?, &mut out)?;
        let got: Vec<u64> = bytemuck::pod_collect_to_vec(&b.download(&out)?);
        for (i, (&g, &id)) in got.iter().zip(&ids).enumerate() {
            let want = reference::page_checksum(&pool[r.page_range(id as usize)]);
            if g == want {
                stats.count += 1;
            } else {
                stats.fail(i, g as f64, want as f64);
            }
        }
    }
    Ok(Outcome::new(Quantity::Checksums, stats, t))
}
