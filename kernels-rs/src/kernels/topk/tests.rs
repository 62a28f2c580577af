//! The top-k kernel on the emulator against a naive specification: random rows, ties,
//! invalid entries, grid-stride over rows, slots through the page table.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use super::*;
use crate::emu::{
    launch_checked, launch_kernel, BufferAccess, EmuTarget, GlobalBuffers, LaunchConfig, Params,
};
use crate::global::{GlobalMut, GlobalPtr};
use crate::launch::Launch;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The specification: valid entries sorted by value (descending), ties to the lower
/// position, the first k, in ascending position order, `-1` padded.
fn naive(row: &[f32], start: usize, k: usize) -> Vec<i32> {
    let mut idx: Vec<usize> = (0..row.len())
        .filter(|&i| row[i] > f32::NEG_INFINITY)
        .collect();
    idx.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap().then(a.cmp(&b)));
    idx.truncate(k);
    idx.sort_unstable();
    let mut v: Vec<i32> = idx.into_iter().map(|i| (i + start) as i32).collect();
    v.resize(k, -1);
    v
}

/// Runs the kernel over rows given as (start, values of [start, start + len)).
fn run(rows: &[(usize, Vec<f32>)], k: usize, grid: Option<u32>) -> Vec<i32> {
    let stride = rows.iter().map(|(s, v)| s + v.len()).max().unwrap() + 3;
    let mut logits = vec![f32::NAN; rows.len() * stride];
    let mut ranges = Vec::new();
    for (r, (s, v)) in rows.iter().enumerate() {
        logits[r * stride + s..][..v.len()].copy_from_slice(v);
        ranges.push(QueryRange {
            request: 0,
            start: *s as u32,
            end: (s + v.len()) as u32,
        });
    }
    let mut out = vec![i32::MIN; rows.len() * k];
    let (ws_bytes, cnt_bytes) = topk_workspace(rows.len() as u32, stride as u32, k as u32);
    let mut ws = vec![0u32; ws_bytes as usize / 4];
    let mut counters = vec![0u32; cnt_bytes as usize / 4];
    let mut bufs = GlobalBuffers::new("topk");
    bufs.add_slice("workspace", &ws, BufferAccess::Write)
        .unwrap();
    bufs.add_slice("counters", &counters, BufferAccess::ReadWrite)
        .unwrap();
    bufs.add_slice("logits", &logits, BufferAccess::Read)
        .unwrap();
    bufs.add_slice("rows", &ranges, BufferAccess::Read).unwrap();
    bufs.add_slice("out", &out, BufferAccess::Write).unwrap();
    let p = TopkParams {
        logits: GlobalPtr::from_raw(logits.as_ptr()),
        rows: GlobalPtr::from_raw(ranges.as_ptr()),
        page_table: GlobalPtr::null(),
        out: GlobalMut::from_raw(out.as_mut_ptr()),
        n_rows: rows.len() as u32,
        k: k as u32,
        row_stride: stride as u32,
        page_size: 0,
        max_pages: 0,
        chunk: topk_chunk(k as u32),
        workspace: GlobalMut::from_raw(ws.as_mut_ptr()),
        counters: GlobalMut::from_raw(counters.as_mut_ptr()),
        take_all_short: 0,
        _pad: 0,
    };
    let l: Launch = topk_launch(&p);
    let cfg = LaunchConfig {
        grid: grid.unwrap_or(l.grid),
        block: l.block,
        dyn_smem_bytes: l.smem_bytes as usize,
    };
    // SAFETY: the buffers outlive the launch; rows write disjoint outputs.
    let p = unsafe { Params::new(p) };
    // SAFETY: the kernel's contract holds for these buffers.
    launch_checked(cfg, &bufs, || unsafe { topk::<crate::emu::Emu>(p.get()) }).unwrap();
    assert!(counters.iter().all(|&c| c == 0), "counters back to zero");
    out
}

fn check(rows: &[(usize, Vec<f32>)], k: usize, grid: Option<u32>) {
    let got = run(rows, k, grid);
    for (r, (s, v)) in rows.iter().enumerate() {
        let want = naive(v, *s, k);
        assert_eq!(
            &got[r * k..(r + 1) * k],
            &want[..],
            "row {r}, len {}, k {k}",
            v.len()
        );
    }
}

fn rng() -> StdRng {
    let seed = rand::random();
    eprintln!("seed {seed}");
    StdRng::seed_from_u64(seed)
}

#[test]
fn random_rows_large_k() {
    let mut g = rng();
    let rows: Vec<(usize, Vec<f32>)> = [20_000usize, 4097, 5000, 12_345, 140_000]
        .iter()
        .map(|&n| {
            (
                g.gen_range(0..9),
                (0..n).map(|_| g.gen_range(-4.0f32..4.0)).collect(),
            )
        })
        .collect();
    check(&rows, 5000, None);
}

#[test]
fn more_than_4096_ties_at_the_threshold() {
    let mut g = rng();
    let n = 40_000;
    let mut row: Vec<f32> = (0..n).map(|_| g.gen_range(-3.0f32..0.5)).collect();
    for _ in 0..1000 {
        row[g.gen_range(0..n)] = 10.0 + g.gen::<f32>();
    }
    for _ in 0..9000 {
        row[g.gen_range(0..n)] = 0.75;
    }
    // Some -0.0 / +0.0 ties too.
    let mut row2 = row.clone();
    for (i, x) in row2.iter_mut().enumerate() {
        if i % 3 == 0 {
            *x = if i % 2 == 0 { -0.0 } else { 0.0 };
        }
    }
    check(&[(5, row), (0, row2)], 2048, None);
}

#[test]
fn all_equal_invalid_and_short_rows() {
    let mut g = rng();
    let mut rows = vec![
        (0, vec![1.5f32; 9000]),
        (3, vec![-0.0f32; 3000]),
        (0, vec![f32::NEG_INFINITY; 2500]),
        (1, vec![f32::NAN; 100]),
        (0, vec![]),
        (2, vec![0.25]),
    ];
    let mut mixed: Vec<f32> = (0..10_000).map(|_| g.gen_range(-1.0f32..1.0)).collect();
    for x in mixed.iter_mut() {
        match g.gen_range(0..6) {
            0 => *x = f32::NEG_INFINITY,
            1 => *x = f32::NAN,
            2 => *x = -0.0,
            3 => *x = 0.0,
            _ => {}
        }
    }
    rows.push((7, mixed));
    // More than k positions but at most k valid.
    let mut sparse = vec![f32::NAN; 6000];
    for i in (0..6000).step_by(5) {
        sparse[i] = g.gen_range(-1.0f32..1.0);
    }
    rows.push((0, sparse));
    // Exactly 2048 entries in the top bin of pass 1 (the search ends there for k=2048).
    let mut two = vec![-100.0f32; 7000];
    for i in 0..2048 {
        two[(i * 3 + 1) % 7000] = 100.0 + (i % 5) as f32;
    }
    rows.push((0, two));
    check(&rows, 2048, None);
    check(&rows, 64, None);
    check(&rows, 1, None);
}

/// Random rows of every shape: few distinct values (ties at every radix level), values
/// one ulp apart (the threshold found only in pass 3), `±0.0`, NaN and `-inf`.
#[test]
fn fuzz_against_the_specification() {
    let mut g = rng();
    for _ in 0..12 {
        let k = match g.gen_range(0..4) {
            0 => g.gen_range(1..70),
            1 => 2048,
            2 => g.gen_range(2000..2100),
            _ => g.gen_range(4096..7000),
        };
        let rows: Vec<(usize, Vec<f32>)> = (0..4)
            .map(|_| {
                let n = match g.gen_range(0..3) {
                    0 => g.gen_range(0..k + 3),
                    1 => g.gen_range(k..3 * k + 10),
                    _ => g.gen_range(0..40_000),
                };
                let style = g.gen_range(0..5);
                let base = g.gen_range(-3.0f32..3.0).to_bits();
                let v = (0..n)
                    .map(|_| {
                        let x = match style {
                            0 => g.gen_range(-5.0f32..5.0),
                            1 => g.gen_range(0..3) as f32 - 1.0,
                            2 => f32::from_bits(base ^ g.gen_range(0..6u32)),
                            3 => f32::from_bits(base ^ g.gen_range(0..3000u32)),
                            _ => g.gen_range(0..40) as f32 * 0.25,
                        };
                        match g.gen_range(0..12) {
                            0 => f32::NEG_INFINITY,
                            1 => f32::NAN,
                            2 => -0.0,
                            3 => 0.0,
                            _ => x,
                        }
                    })
                    .collect();
                (g.gen_range(0..5), v)
            })
            .collect();
        check(&rows, k, None);
    }
}

#[test]
fn grid_stride_over_rows() {
    let mut g = rng();
    let rows: Vec<(usize, Vec<f32>)> = (0..5)
        .map(|i| {
            (
                i,
                (0..3000 + 100 * i)
                    .map(|_| g.gen_range(-2.0f32..2.0))
                    .collect(),
            )
        })
        .collect();
    check(&rows, 100, Some(2));
}

#[test]
fn slots_through_the_page_table() {
    let (ps, max_pages) = (16usize, 8usize);
    let row: Vec<f32> = (0..100).map(|i| ((i * 37) % 101) as f32).collect();
    let pages: Vec<i32> = vec![5, 2, 7, 0, 1, 3, 4, 6, 9, 8, 11, 10, 13, 12, 15, 14];
    let ranges = [QueryRange {
        request: 1,
        start: 4,
        end: 100,
    }];
    let mut out = vec![0i32; 10];
    let mut bufs = GlobalBuffers::new("topk");
    bufs.add_slice("logits", &row, BufferAccess::Read).unwrap();
    bufs.add_slice("rows", &ranges, BufferAccess::Read).unwrap();
    bufs.add_slice("page_table", &pages, BufferAccess::Read)
        .unwrap();
    bufs.add_slice("out", &out, BufferAccess::Write).unwrap();
    let p = TopkParams {
        logits: GlobalPtr::from_raw(row.as_ptr()),
        rows: GlobalPtr::from_raw(ranges.as_ptr()),
        page_table: GlobalPtr::from_raw(pages.as_ptr()),
        out: GlobalMut::from_raw(out.as_mut_ptr()),
        n_rows: 1,
        k: 10,
        row_stride: 100,
        page_size: ps as u32,
        max_pages: max_pages as u32,
        chunk: topk_chunk(10),
        workspace: GlobalMut::null(),
        counters: GlobalMut::null(),
        take_all_short: 0,
        _pad: 0,
    };
    // SAFETY: the buffers (registered) outlive the launch; the kernel's contract holds.
    unsafe { launch_kernel(EmuTarget::Generic, p, &bufs) }.unwrap();
    let want: Vec<i32> = naive(&row[4..], 4, 10)
        .into_iter()
        .map(|c| {
            let c = c as usize;
            (pages[max_pages + c / ps] as usize * ps + c % ps) as i32
        })
        .collect();
    assert_eq!(out, want);
}

/// Rows past one chunk (split, merged by the last block): ties across chunk boundaries,
/// valid entries only in some chunks, a start that is not chunk-aligned, a partial last
/// chunk, k larger than a chunk's valid entries.
#[test]
fn split_rows_merge_exactly() {
    let mut g = rng();
    let n = 3 * 8192 + 777;
    let all_equal = vec![1.5f32; n];
    let mut sparse = vec![f32::NEG_INFINITY; n];
    for i in (2 * 8192..n).step_by(97) {
        sparse[i] = g.gen_range(-1.0f32..1.0);
    }
    let mut boundary_ties: Vec<f32> = (0..n).map(|_| g.gen_range(-3.0f32..0.0)).collect();
    for c in 1..4 {
        for d in 0..40 {
            boundary_ties[c * 8192 - 20 + d] = 2.0;
        }
    }
    let mut with_nan: Vec<f32> = (0..n).map(|_| g.gen_range(-1.0f32..1.0)).collect();
    for i in (0..n).step_by(5) {
        with_nan[i] = f32::NAN;
    }
    let rows = vec![
        (0, all_equal),
        (13, sparse),
        (5000, boundary_ties),
        (1, with_nan),
    ];
    for k in [100, 300, 2048] {
        check(&rows, k, None);
        check(&rows, k, Some(3));
    }
}
