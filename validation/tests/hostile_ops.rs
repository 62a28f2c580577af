//! Every op's validator driven with hostile sizes, offsets, strides, `k`, head counts and
//! ids (near `usize::MAX`, `i32::MAX`, `u32::MAX`, `2^62`, `2^63`, negative) on the cpu and
//! emu backends, with buffers sized by the *wrapped* products an unchecked validator would
//! compute (the attack: a product that wraps to a small size matching a small buffer).
//!
//! Each call must either fail with a typed op error ([`ErrorKind::Op`]) leaving every
//! buffer byte-identical, or succeed with the reference's result — and inputs unchanged.
//! Never a panic, an abort, or a write outside the outputs. Proptest shrinks any failure
//! to a minimal call and records it in `hostile_ops.proptest-regressions`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use half::bf16;
use proptest::prelude::*;
use sparsekit_host::layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout, PageLayout};
use sparsekit_host::ops::{
    CopyPages, IndexKStore, IndexerLogits, KvStore, Op, PageChecksums, PageTable, PagedRegion,
    QueryRange, SparseMla, Topk, TopkOutput,
};
use sparsekit_host::{Backend, CpuBackend, EmuBackend, Error, ErrorKind};
use sparsekit_validation::fixtures::{self, bytes_of, case_rng};
use sparsekit_validation::reference;
use sparsekit_validation::tolerance::{self, ErrorStats, Quantity};

/// Largest buffer the tests allocate (bytes).
const CAP: usize = 1 << 15;

/// Sizes: mostly small, often at or past a 32/64-bit boundary.
fn size() -> BoxedStrategy<usize> {
    prop_oneof![
        8 => 0usize..=24,
        1 => Just(u32::MAX as usize),
        1 => Just(u32::MAX as usize + 1),
        1 => Just(i32::MAX as usize),
        1 => Just(i32::MAX as usize + 1),
        1 => Just(usize::MAX),
        2 => Just(usize::MAX - 99),
        1 => Just(1usize << 62),
        2 => Just((1usize << 62) + 1),
        2 => Just((1usize << 62) + 16),
        2 => Just(1usize << 63),
        1 => any::<usize>(),
    ]
    .boxed()
}

/// i32 ids (pages, slots, table entries).
fn id32() -> BoxedStrategy<i32> {
    prop_oneof![
        6 => -2i32..24,
        1 => Just(i32::MAX),
        1 => Just(i32::MAX - 1),
        1 => Just(i32::MIN),
        1 => any::<i32>(),
    ]
    .boxed()
}

/// u32 values (query-range fields, context lengths).
fn u32v() -> BoxedStrategy<u32> {
    prop_oneof![
        6 => 0u32..40,
        1 => Just(u32::MAX),
        1 => Just(i32::MAX as u32),
        1 => Just(i32::MAX as u32 + 1),
        1 => any::<u32>(),
    ]
    .boxed()
}

/// i64 store slots.
fn slot64() -> BoxedStrategy<i64> {
    prop_oneof![
        6 => -2i64..40,
        1 => Just(i64::MAX),
        1 => Just(i64::MIN),
        1 => Just(u32::MAX as i64),
        1 => Just(i32::MAX as i64 + 1),
        1 => any::<i64>(),
    ]
    .boxed()
}

/// A buffer length: the wrapped product of `factors` when it is small (the attack),
/// else a small length picked by `pick`.
fn wrapped_len(factors: &[usize], pick: usize) -> usize {
    let wrapped = factors.iter().fold(1usize, |a, &f| a.wrapping_mul(f));
    match pick % 4 {
        0..=2 if wrapped <= CAP => wrapped,
        _ => pick % CAP,
    }
}

fn index_layouts() -> [IndexKLayout; 2] {
    [
        IndexKLayout::new(IndexKDtype::FP8, 16, 4).unwrap(),
        IndexKLayout::new(IndexKDtype::Bf16, 16, 4).unwrap(),
    ]
}

fn kv_layouts() -> [KvLayout; 2] {
    [
        KvLayout::new(KvDtype::Bf16, 16, 16, 4).unwrap(),
        KvLayout::new(KvDtype::Fp8DsMla, 128, 16, 2).unwrap(),
    ]
}

/// One hostile call of one op: its host buffers, how to run it, how to judge an
/// accepted result.
trait Case: std::fmt::Debug {
    /// Input and output buffers, as host bytes.
    fn buffers(&self) -> (Vec<Vec<u8>>, Vec<Vec<u8>>);
    /// Runs the op on `b` (an error from building the descriptor counts as a rejection).
    fn call<B: Backend>(
        &self,
        b: &B,
        ins: &[B::Buffer],
        outs: &mut [B::Buffer],
    ) -> Result<(), Error>;
    /// Judges the outputs of an accepted call (`ins`, `outs`: the buffers before it).
    fn check(&self, ins: &[Vec<u8>], outs: &[Vec<u8>], got: &[Vec<u8>]) -> Result<(), String>;
}

/// Runs `c` on `b`: a rejected call must be a typed op error that wrote nothing; inputs
/// never change; an accepted call must pass `c.check`.
fn exercise_on<B: Backend, C: Case>(b: &B, c: &C) -> Result<(), TestCaseError> {
    let (inputs, outputs) = c.buffers();
    let ins: Vec<B::Buffer> = inputs.iter().map(|x| b.upload(x).unwrap()).collect();
    let mut outs: Vec<B::Buffer> = outputs.iter().map(|x| b.upload(x).unwrap()).collect();
    let result = c.call(b, &ins, &mut outs);
    for (i, (buf, want)) in ins.iter().zip(&inputs).enumerate() {
        prop_assert!(
            b.download(buf).unwrap() == *want,
            "{}: input {i} changed ({result:?})",
            b.name()
        );
    }
    let got: Vec<Vec<u8>> = outs.iter().map(|x| b.download(x).unwrap()).collect();
    match result {
        Ok(()) => {
            if let Err(why) = c.check(&inputs, &outputs, &got) {
                return Err(TestCaseError::fail(format!(
                    "{}: accepted with a wrong result: {why}",
                    b.name()
                )));
            }
        }
        Err(e) => {
            prop_assert_eq!(e.kind(), ErrorKind::Op, "{}: {}", b.name(), e);
            prop_assert!(!e.to_string().is_empty());
            for (i, (g, want)) in got.iter().zip(&outputs).enumerate() {
                prop_assert!(
                    g == want,
                    "{}: rejected call ({e}) wrote output {i}",
                    b.name()
                );
            }
        }
    }
    Ok(())
}

/// [`exercise_on`] on the cpu and emu backends.
fn exercise<C: Case>(c: &C) -> Result<(), TestCaseError> {
    exercise_on(&CpuBackend::new(), c)?;
    exercise_on(&EmuBackend::new(), c)
}

fn bf16s(bytes: &[u8]) -> Vec<bf16> {
    bytemuck::pod_collect_to_vec(bytes)
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytemuck::pod_collect_to_vec(bytes)
}

fn i32s(bytes: &[u8]) -> Vec<i32> {
    bytemuck::pod_collect_to_vec(bytes)
}

/// Random bytes of whole bf16/f32 values when `len` allows (else raw bytes).
fn data(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = case_rng(seed, len as u64);
    let vals = fixtures::bf16_normal(&mut rng, len / 2, 1.0);
    let mut out = bytes_of(&vals).to_vec();
    out.resize(len, 0x3c);
    out
}

// ------------------------------------------------------------------------------ pages

#[derive(Debug)]
struct CopyCase {
    src: PagedRegion,
    dst: PagedRegion,
    src_ids: Vec<i32>,
    dst_ids: Vec<i32>,
    src_len: usize,
    dst_len: usize,
}

impl Case for CopyCase {
    fn buffers(&self) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
        let src: Vec<u8> = (0..self.src_len).map(|i| (i * 7 + 1) as u8).collect();
        (vec![src], vec![vec![0xA5; self.dst_len]])
    }
    fn call<B: Backend>(
        &self,
        b: &B,
        ins: &[B::Buffer],
        outs: &mut [B::Buffer],
    ) -> Result<(), Error> {
        let op = CopyPages {
            src: self.src,
            dst: self.dst,
            src_ids: &self.src_ids,
            dst_ids: &self.dst_ids,
        };
        b.copy_pages(&op, &ins[0], &mut outs[0])
    }
    fn check(&self, ins: &[Vec<u8>], outs: &[Vec<u8>], got: &[Vec<u8>]) -> Result<(), String> {
        let mut want = outs[0].clone();
        reference::copy_pages(
            &self.src,
            &self.dst,
            &ins[0],
            &mut want,
            &self.src_ids,
            &self.dst_ids,
        );
        (got[0] == want)
            .then_some(())
            .ok_or_else(|| "copied bytes differ".into())
    }
}

/// Which fields of a sane call become hostile: none (a valid call) in about a third of
/// the cases, else one or two of `fields`.
fn mutations(fields: usize) -> impl Strategy<Value = Vec<usize>> {
    prop_oneof![1 => Just(Vec::new()), 2 => prop::collection::vec(0..fields, 1..=2)]
}

fn any_page_layout() -> impl Strategy<Value = PageLayout> {
    (0usize..4).prop_map(|i| match i {
        0 | 1 => index_layouts()[i].into(),
        _ => kv_layouts()[i - 2].into(),
    })
}

/// A sane region of `layout`: 1..6 pages, a small offset, a stride of a page or more.
fn sane_region(layout: PageLayout) -> impl Strategy<Value = PagedRegion> {
    (0usize..64, 0usize..32, 1usize..6).prop_map(move |(offset, extra, num_pages)| PagedRegion {
        layout,
        offset,
        stride: layout.bytes_per_page() + extra,
        num_pages,
    })
}

/// Replaces field `f` (0 offset, 1 stride, 2 num_pages) of `r` by `v`.
fn spoil_region(r: &mut PagedRegion, f: usize, v: usize) {
    match f {
        0 => r.offset = v,
        1 => r.stride = v,
        _ => r.num_pages = v,
    }
}

/// The end of a region as an unchecked validator computes it (wrapping), when small
/// enough to allocate; else `fallback`.
fn region_len(r: &PagedRegion, fallback: usize) -> usize {
    let end = r
        .num_pages
        .wrapping_sub(1)
        .wrapping_mul(r.stride)
        .wrapping_add(r.layout.bytes_per_page())
        .wrapping_add(r.offset);
    if end <= CAP {
        end
    } else {
        fallback % CAP
    }
}

/// `count` distinct ids below `n` (shuffled), as i32.
fn distinct_ids(n: usize, count: usize) -> impl Strategy<Value = Vec<i32>> {
    Just((0..n as i32).collect::<Vec<i32>>())
        .prop_shuffle()
        .prop_map(move |mut v| {
            v.truncate(count);
            v
        })
}

fn copy_case() -> impl Strategy<Value = CopyCase> {
    any_page_layout()
        .prop_flat_map(|layout| (sane_region(layout), sane_region(layout), 0usize..4))
        .prop_flat_map(|(src, dst, c)| {
            let c = c.min(src.num_pages).min(dst.num_pages);
            (
                Just((src, dst)),
                distinct_ids(src.num_pages, c),
                distinct_ids(dst.num_pages, c),
                mutations(10),
                (size(), id32(), any::<usize>()),
            )
        })
        .prop_map(
            |((mut src, mut dst), mut src_ids, mut dst_ids, muts, (v, id, pick))| {
                let (mut src_len, mut dst_len) = (None, None);
                for f in muts {
                    match f {
                        0..=2 => spoil_region(&mut src, f, v),
                        3..=5 => spoil_region(&mut dst, f - 3, v),
                        6 => src_ids.push(id),
                        7 => match dst_ids.first_mut() {
                            Some(d) => *d = id,
                            None => dst_ids.push(id),
                        },
                        8 => src_len = Some(pick % CAP),
                        _ => dst_len = Some(pick % CAP),
                    }
                }
                CopyCase {
                    src_len: src_len.unwrap_or_else(|| region_len(&src, pick)),
                    dst_len: dst_len.unwrap_or_else(|| region_len(&dst, pick)),
                    src,
                    dst,
                    src_ids,
                    dst_ids,
                }
            },
        )
}

#[derive(Debug)]
struct ChecksumCase {
    region: PagedRegion,
    ids: Vec<i32>,
    pool_len: usize,
    out_len: usize,
}

impl Case for ChecksumCase {
    fn buffers(&self) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
        let pool: Vec<u8> = (0..self.pool_len).map(|i| (i * 13 + 5) as u8).collect();
        (vec![pool], vec![vec![0x5A; self.out_len]])
    }
    fn call<B: Backend>(
        &self,
        b: &B,
        ins: &[B::Buffer],
        outs: &mut [B::Buffer],
    ) -> Result<(), Error> {
        let op = PageChecksums {
            region: self.region,
            ids: &self.ids,
        };
        b.page_checksums(&op, &ins[0], &mut outs[0])
    }
    fn check(&self, ins: &[Vec<u8>], _: &[Vec<u8>], got: &[Vec<u8>]) -> Result<(), String> {
        let got: Vec<u64> = bytemuck::pod_collect_to_vec(&got[0]);
        for (g, &id) in got.iter().zip(&self.ids) {
            let want = reference::page_checksum(&ins[0][self.region.page_range(id as usize)]);
            if *g != want {
                return Err(format!("checksum of page {id}: {g:#x}, want {want:#x}"));
            }
        }
        (got.len() == self.ids.len())
            .then_some(())
            .ok_or_else(|| "count".into())
    }
}

fn checksum_case() -> impl Strategy<Value = ChecksumCase> {
    any_page_layout()
        .prop_flat_map(|layout| (sane_region(layout), 0usize..5))
        .prop_flat_map(|(region, c)| {
            (
                Just(region),
                prop::collection::vec(0..region.num_pages as i32, c),
                mutations(6),
                (size(), id32(), any::<usize>()),
            )
        })
        .prop_map(|(mut region, mut ids, muts, (v, id, pick))| {
            let (mut pool_len, mut out_len) = (None, None);
            for f in muts {
                match f {
                    0..=2 => spoil_region(&mut region, f, v),
                    3 => ids.push(id),
                    4 => pool_len = Some(pick % CAP),
                    _ => out_len = Some(wrapped_len(&[v, 8], pick)),
                }
            }
            ChecksumCase {
                pool_len: pool_len.unwrap_or_else(|| region_len(&region, pick)),
                out_len: out_len.unwrap_or(ids.len() * 8),
                region,
                ids,
            }
        })
}

// ------------------------------------------------------------------------------ stores

#[derive(Debug)]
struct StoreCase {
    layout: PageLayout,
    slots: Vec<i64>,
    src_len: usize,
    cache_len: usize,
    seed: u64,
}

impl Case for StoreCase {
    fn buffers(&self) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
        let cache: Vec<u8> = (0..self.cache_len).map(|i| (i * 31 + 3) as u8).collect();
        (vec![data(self.seed, self.src_len)], vec![cache])
    }
    fn call<B: Backend>(
        &self,
        b: &B,
        ins: &[B::Buffer],
        outs: &mut [B::Buffer],
    ) -> Result<(), Error> {
        match self.layout {
            PageLayout::IndexK(layout) => b.index_k_store(
                &IndexKStore {
                    layout,
                    slots: &self.slots,
                },
                &ins[0],
                &mut outs[0],
            ),
            PageLayout::Kv(layout) => b.kv_store(
                &KvStore {
                    layout,
                    slots: &self.slots,
                },
                &ins[0],
                &mut outs[0],
            ),
        }
    }
    fn check(&self, ins: &[Vec<u8>], outs: &[Vec<u8>], got: &[Vec<u8>]) -> Result<(), String> {
        let mut want = outs[0].clone();
        let src = bf16s(&ins[0]);
        match self.layout {
            PageLayout::IndexK(l) => reference::index_k_store(&l, &mut want, &src, &self.slots),
            PageLayout::Kv(l) => reference::kv_store(&l, &mut want, &src, &self.slots),
        }
        (got[0] == want)
            .then_some(())
            .ok_or_else(|| "cache bytes differ".into())
    }
}

fn store_case() -> impl Strategy<Value = StoreCase> {
    (any_page_layout(), 1usize..6, 0usize..6)
        .prop_flat_map(|(layout, pages, n)| {
            let capacity = pages * layout.page_size();
            (
                Just((layout, pages)),
                distinct_ids(capacity, n),
                mutations(5),
                (slot64(), any::<usize>(), any::<u64>()),
            )
        })
        .prop_map(|((layout, pages), ids, muts, (hostile, pick, seed))| {
            let dim = match layout {
                PageLayout::IndexK(l) => l.head_dim(),
                PageLayout::Kv(l) => l.d_qk(),
            };
            // Every third token skipped.
            let mut slots: Vec<i64> = ids
                .iter()
                .enumerate()
                .map(|(i, &s)| if i % 3 == 2 { -1 } else { s as i64 })
                .collect();
            let (mut src_len, mut cache_len) = (None, pages * layout.bytes_per_page());
            for f in muts {
                match f {
                    0 => match slots.first_mut() {
                        Some(s) => *s = hostile,
                        None => slots.push(hostile),
                    },
                    1 => {
                        if let Some(&s) = slots.iter().find(|&&s| s >= 0) {
                            slots.push(s);
                        }
                    }
                    2 => slots.push(hostile),
                    3 => src_len = Some(pick % CAP),
                    _ => cache_len = pick % CAP,
                }
            }
            StoreCase {
                layout,
                src_len: src_len.unwrap_or(slots.len() * dim * 2),
                cache_len,
                slots,
                seed,
            }
        })
}

// ------------------------------------------------------------------------------ indexer

#[derive(Debug)]
struct IndexerCase {
    layout: IndexKLayout,
    n_heads: usize,
    table: Vec<i32>,
    max_pages: usize,
    rows: Rows,
    row_stride: usize,
    pages: usize,
    lens: [usize; 3],
    seed: u64,
}

/// The query rows of an indexer or top-k case.
#[derive(Clone, Debug)]
enum Rows {
    Explicit(Vec<QueryRange>),
    Decode {
        context_lens: Vec<u32>,
        next_n: usize,
    },
}

impl Rows {
    fn get(&self) -> Result<Vec<QueryRange>, Error> {
        match self {
            Rows::Explicit(r) => Ok(r.clone()),
            Rows::Decode {
                context_lens,
                next_n,
            } => sparsekit_host::ops::decode_rows(context_lens, *next_n),
        }
    }
    /// The row count an unchecked caller would assume.
    fn nominal(&self) -> usize {
        match self {
            Rows::Explicit(r) => r.len(),
            Rows::Decode {
                context_lens,
                next_n,
            } => context_lens.len().wrapping_mul(*next_n),
        }
    }
}

/// A sane ragged batch: 1..4 requests of 0..20 tokens over shuffled pages of a pool
/// (plus one spare page); entries past a request's tokens are -1, and so (sometimes) are
/// the entries before every row's window; rows in the explicit or the decode form.
#[derive(Clone, Debug)]
struct Batch {
    table: Vec<i32>,
    max_pages: usize,
    pages: usize,
    rows: Rows,
    /// Largest row end.
    max_end: usize,
}

fn batch(page_size: usize) -> impl Strategy<Value = Batch> {
    prop::collection::vec(0u32..20, 1..4)
        .prop_flat_map(move |lens| {
            let need: Vec<usize> = lens
                .iter()
                .map(|&l| (l as usize).div_ceil(page_size))
                .collect();
            let pages = need.iter().sum::<usize>() + 1;
            (
                Just(lens),
                Just(need),
                distinct_ids(pages, pages),
                prop::collection::vec((0u32..20, 0u32..20), 0..4),
                1usize..3,
                any::<bool>(),
            )
        })
        .prop_map(move |(lens, need, perm, windows, next_n, decode)| {
            let max_pages = need.iter().copied().max().unwrap_or(0) + 1;
            let mut table = vec![-1i32; lens.len() * max_pages];
            let mut ids = perm.iter();
            for (r, &n) in need.iter().enumerate() {
                for p in 0..n {
                    table[r * max_pages + p] = *ids.next().unwrap_or(&0);
                }
            }
            let rows = if decode && lens.iter().all(|&l| l as usize >= next_n) {
                Rows::Decode {
                    context_lens: lens.clone(),
                    next_n,
                }
            } else {
                let mut rows = Vec::new();
                for (i, (a, b)) in windows.into_iter().enumerate() {
                    let r = i % lens.len();
                    let (s, e) = (
                        (a % (lens[r] + 1)).min(b % (lens[r] + 1)),
                        (a % (lens[r] + 1)).max(b % (lens[r] + 1)),
                    );
                    // A window: the pages wholly before it are evicted.
                    if i % 2 == 1 && lens.len() == 1 {
                        for p in 0..s as usize / page_size {
                            table[r * max_pages + p] = -1;
                        }
                    }
                    rows.push(QueryRange {
                        request: r as u32,
                        start: s,
                        end: e,
                    });
                }
                Rows::Explicit(rows)
            };
            Batch {
                table,
                max_pages,
                pages: need.iter().sum::<usize>() + 1,
                max_end: lens.iter().copied().max().unwrap_or(0) as usize,
                rows,
            }
        })
}

/// Replaces one field of a batch by a hostile value: a row's request, start or end, a
/// table entry, `next_n` or a context length.
fn spoil_batch(b: &mut Batch, which: usize, v: usize, id: i32, u: u32) {
    match &mut b.rows {
        Rows::Explicit(rows) => match (rows.first_mut(), which % 4) {
            (Some(q), 0) => q.request = u,
            (Some(q), 1) => q.start = u,
            (Some(q), 2) => q.end = u,
            (None, 0..=2) => rows.push(QueryRange {
                request: u,
                start: 0,
                end: u,
            }),
            _ => {
                if let Some(t) = b.table.iter_mut().find(|t| **t >= 0) {
                    *t = id;
                }
            }
        },
        Rows::Decode {
            context_lens,
            next_n,
        } => match which % 3 {
            0 => *next_n = v,
            1 => {
                if let Some(l) = context_lens.first_mut() {
                    *l = u;
                }
            }
            _ => {
                if let Some(t) = b.table.iter_mut().find(|t| **t >= 0) {
                    *t = id;
                }
            }
        },
    }
}

impl IndexerCase {
    fn op(&self) -> Result<IndexerLogits<'_>, Error> {
        Ok(IndexerLogits {
            layout: self.layout,
            n_heads: self.n_heads,
            page_table: PageTable::new(&self.table, self.max_pages)?,
            rows: self.rows.get()?,
            row_stride: self.row_stride,
        })
    }
}

impl Case for IndexerCase {
    fn buffers(&self) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
        let l = self.layout;
        // A cache of real keys (every slot stored by the reference).
        let mut cache = vec![0u8; l.buffer_bytes(self.pages)];
        let mut rng = case_rng(self.seed, 1);
        let slots: Vec<i64> = (0..(self.pages * l.page_size()) as i64).collect();
        let keys = fixtures::token_rows(&mut rng, slots.len(), l.head_dim());
        reference::index_k_store(&l, &mut cache, &keys, &slots);
        let [q, w, out] = self.lens;
        let weights: Vec<f32> = (0..w / 4).map(|i| 0.1 + (i % 7) as f32 * 0.03).collect();
        let mut wb = bytes_of(&weights).to_vec();
        wb.resize(w, 0);
        (
            vec![data(self.seed, q), wb, cache],
            vec![fixtures::poison_f32(out / 4)
                .into_iter()
                .chain(std::iter::repeat(0x7f))
                .take(out)
                .collect()],
        )
    }
    fn call<B: Backend>(
        &self,
        b: &B,
        ins: &[B::Buffer],
        outs: &mut [B::Buffer],
    ) -> Result<(), Error> {
        b.indexer_logits(&self.op()?, &ins[0], &ins[1], &ins[2], &mut outs[0])
    }
    fn check(&self, ins: &[Vec<u8>], _: &[Vec<u8>], got: &[Vec<u8>]) -> Result<(), String> {
        let op = self.op().map_err(|e| e.to_string())?;
        let want = reference::indexer_logits(
            &self.layout,
            &ins[2],
            &op.page_table,
            &op.rows,
            self.n_heads,
            &bf16s(&ins[0]),
            &f32s(&ins[1]),
            self.row_stride,
        );
        let t = tolerance::get(
            Op::IndexerLogits,
            Quantity::Logits,
            self.layout.dtype().into(),
        )
        .map_err(|e| e.to_string())?;
        let mut stats = ErrorStats::default();
        for (i, g) in f32s(&got[0]).iter().enumerate() {
            stats.add_nonfinite(i, *g as f64, want.logits[i], want.magnitude[i], t);
        }
        (stats.failures == 0)
            .then_some(())
            .ok_or_else(|| stats.summary())
    }
}

fn indexer_case() -> impl Strategy<Value = IndexerCase> {
    (0usize..2)
        .prop_flat_map(|li| {
            let layout = index_layouts()[li];
            (
                Just(layout),
                1usize..5,
                batch(layout.page_size()),
                0usize..4,
                mutations(8),
                (size(), id32(), u32v(), any::<usize>(), any::<u64>()),
            )
        })
        .prop_map(
            |(layout, mut n_heads, mut b, pad, muts, (v, id, u, pick, seed))| {
                let mut row_stride = b.max_end + pad;
                let mut lens: [Option<usize>; 3] = [None; 3];
                for f in muts {
                    match f {
                        0 => n_heads = v,
                        1 => row_stride = v,
                        2..=4 => spoil_batch(&mut b, f + pick, v, id, u),
                        _ => lens[f - 5] = Some(pick % CAP),
                    }
                }
                // Unless spoilt themselves, buffers are sized by the wrapped products.
                let n = b.rows.nominal();
                let d = layout.head_dim();
                let lens = [
                    lens[0].unwrap_or_else(|| wrapped_len(&[n, n_heads, d, 2], 0)),
                    lens[1].unwrap_or_else(|| wrapped_len(&[n, n_heads, 4], 0)),
                    lens[2].unwrap_or_else(|| wrapped_len(&[n, row_stride, 4], 0)),
                ];
                IndexerCase {
                    layout,
                    n_heads,
                    table: b.table,
                    max_pages: b.max_pages,
                    rows: b.rows,
                    row_stride,
                    pages: b.pages,
                    lens,
                    seed,
                }
            },
        )
}

// ------------------------------------------------------------------------------ top-k

#[derive(Debug)]
struct TopkCase {
    k: usize,
    row_stride: usize,
    rows: Rows,
    slots: Option<(Vec<i32>, usize, usize)>,
    lens: [usize; 2],
    seed: u64,
}

impl TopkCase {
    fn run_op<R>(&self, f: impl FnOnce(&Topk<'_>) -> Result<R, Error>) -> Result<R, Error> {
        let rows = self.rows.get()?;
        let output = match &self.slots {
            None => TopkOutput::Positions,
            Some((t, max_pages, page_size)) => TopkOutput::Slots {
                page_table: PageTable::new(t, *max_pages)?,
                page_size: *page_size,
            },
        };
        f(&Topk {
            short_rows: sparsekit_host::ops::ShortRows::SelectValid,
            k: self.k,
            row_stride: self.row_stride,
            rows: &rows,
            output,
        })
    }
}

impl Case for TopkCase {
    fn buffers(&self) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
        let [logits, out] = self.lens;
        let mut rng = case_rng(self.seed, 2);
        let vals: Vec<f32> = (0..logits / 4)
            .map(|i| match i % 11 {
                3 => f32::NEG_INFINITY,
                7 => f32::NAN,
                _ => fixtures::normal(&mut rng) as f32,
            })
            .collect();
        let mut lb = bytes_of(&vals).to_vec();
        lb.resize(logits, 0);
        (vec![lb], vec![vec![0x7f; out]])
    }
    fn call<B: Backend>(
        &self,
        b: &B,
        ins: &[B::Buffer],
        outs: &mut [B::Buffer],
    ) -> Result<(), Error> {
        self.run_op(|op| b.topk(op, &ins[0], &mut outs[0]))
    }
    fn check(&self, ins: &[Vec<u8>], _: &[Vec<u8>], got: &[Vec<u8>]) -> Result<(), String> {
        let logits = f32s(&ins[0]);
        let got = i32s(&got[0]);
        self.run_op(|op| {
            let k = op.k;
            for (r, range) in op.rows.iter().enumerate() {
                let row = &logits[r * op.row_stride..(r + 1) * op.row_stride];
                let (s, e) = (range.start as usize, range.end as usize);
                let mut want: Vec<i32> = reference::topk_row(&row[s..e], k)
                    .into_iter()
                    .map(|p| match op.output {
                        TopkOutput::Positions => (s + p) as i32,
                        TopkOutput::Slots {
                            page_table,
                            page_size,
                        } => page_table.slot(range.request as usize, s + p, page_size) as i32,
                    })
                    .collect();
                want.resize(k, -1);
                if got[r * k..(r + 1) * k] != want[..] {
                    return Err(Error::Device(format!(
                        "row {r}: {:?} vs {want:?}",
                        &got[r * k..(r + 1) * k]
                    )));
                }
            }
            Ok(())
        })
        .map_err(|e| e.to_string())
    }
}

fn topk_case() -> impl Strategy<Value = TopkCase> {
    (1usize..6)
        .prop_flat_map(|page_size| {
            (
                Just(page_size),
                1usize..6,
                batch(page_size),
                0usize..4,
                any::<bool>(),
                mutations(7),
                (size(), id32(), u32v(), any::<usize>(), any::<u64>()),
            )
        })
        .prop_map(
            |(mut page_size, mut k, mut b, pad, slots, muts, (v, id, u, pick, seed))| {
                let mut row_stride = b.max_end + pad;
                let mut lens: [Option<usize>; 2] = [None; 2];
                for f in muts {
                    match f {
                        0 => k = v,
                        1 => row_stride = v,
                        2 | 3 => spoil_batch(&mut b, f + pick, v, id, u),
                        4 => page_size = v,
                        _ => lens[f - 5] = Some(pick % CAP),
                    }
                }
                let n = b.rows.nominal();
                TopkCase {
                    lens: [
                        lens[0].unwrap_or_else(|| wrapped_len(&[n, row_stride, 4], 0)),
                        lens[1].unwrap_or_else(|| wrapped_len(&[n, k, 4], 0)),
                    ],
                    k,
                    row_stride,
                    rows: b.rows,
                    slots: slots.then_some((b.table, b.max_pages, page_size)),
                    seed,
                }
            },
        )
}

// ------------------------------------------------------------------------------ sparse MLA

#[derive(Debug)]
struct MlaCase {
    layout: KvLayout,
    n_tokens: usize,
    n_heads: usize,
    topk: usize,
    softmax_scale: f32,
    indices: Vec<i32>,
    pages: usize,
    lens: [usize; 4],
    seed: u64,
}

impl MlaCase {
    fn op(&self) -> SparseMla {
        SparseMla {
            layout: self.layout,
            n_tokens: self.n_tokens,
            n_heads: self.n_heads,
            topk: self.topk,
            softmax_scale: self.softmax_scale,
        }
    }
}

impl Case for MlaCase {
    fn buffers(&self) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
        let l = self.layout;
        let mut cache = vec![0u8; l.buffer_bytes(self.pages)];
        let mut rng = case_rng(self.seed, 3);
        let slots: Vec<i64> = (0..(self.pages * l.page_size()) as i64).collect();
        let kv = fixtures::token_rows(&mut rng, slots.len(), l.d_qk());
        reference::kv_store(&l, &mut cache, &kv, &slots);
        let [q, idx, out, lse] = self.lens;
        let mut ib = bytes_of(&self.indices).to_vec();
        ib.resize(idx, 0xff);
        (
            vec![data(self.seed, q), cache, ib],
            vec![vec![0x7f; out], vec![0x7f; lse]],
        )
    }
    fn call<B: Backend>(
        &self,
        b: &B,
        ins: &[B::Buffer],
        outs: &mut [B::Buffer],
    ) -> Result<(), Error> {
        let (out, lse) = outs.split_at_mut(1);
        b.sparse_mla(
            &self.op(),
            &ins[0],
            &ins[1],
            &ins[2],
            &mut out[0],
            &mut lse[0],
        )
    }
    fn check(&self, ins: &[Vec<u8>], _: &[Vec<u8>], got: &[Vec<u8>]) -> Result<(), String> {
        let op = self.op();
        let want = reference::sparse_mla(
            &self.layout,
            &ins[1],
            &bf16s(&ins[0]),
            &i32s(&ins[2]),
            op.n_tokens,
            op.n_heads,
            op.topk,
            op.softmax_scale,
        );
        let dt = self.layout.dtype().into();
        let to = tolerance::get(Op::SparseMla, Quantity::Out, dt).map_err(|e| e.to_string())?;
        let tl = tolerance::get(Op::SparseMla, Quantity::Lse, dt).map_err(|e| e.to_string())?;
        let mut stats = ErrorStats::default();
        for (i, g) in bf16s(&got[0]).iter().enumerate() {
            stats.add_nonfinite(i, g.to_f64(), want.out[i], want.out_magnitude(i), to);
        }
        for (i, g) in f32s(&got[1]).iter().enumerate() {
            stats.add_nonfinite(i, *g as f64, want.lse[i], want.lse_magnitude[i], tl);
        }
        (stats.failures == 0)
            .then_some(())
            .ok_or_else(|| stats.summary())
    }
}

fn mla_case() -> impl Strategy<Value = MlaCase> {
    (0usize..2, 0usize..4, 1usize..4, 1usize..6, 1usize..4)
        .prop_flat_map(|(li, n_tokens, n_heads, topk, pages)| {
            let layout = kv_layouts()[li];
            let capacity = (pages * layout.page_size()) as i32;
            (
                Just((layout, n_tokens, n_heads, topk, pages)),
                prop::collection::vec(-1..capacity, n_tokens * topk),
                mutations(9),
                (
                    size(),
                    id32(),
                    prop_oneof![Just(f32::NAN), Just(f32::INFINITY), Just(-0.5f32)],
                    any::<usize>(),
                    any::<u64>(),
                ),
            )
        })
        .prop_map(
            |(
                (layout, mut n_tokens, mut n_heads, mut topk, pages),
                mut indices,
                muts,
                (v, id, scale, pick, seed),
            )| {
                let mut softmax_scale = 0.125;
                let mut lens: [Option<usize>; 4] = [None; 4];
                for f in muts {
                    match f {
                        0 => n_tokens = v,
                        1 => n_heads = v,
                        2 => topk = v,
                        3 => softmax_scale = scale,
                        4 => match indices.first_mut() {
                            Some(i) => *i = id,
                            None => indices.push(id),
                        },
                        _ => lens[f - 5] = Some(pick % CAP),
                    }
                }
                let (t, h) = (n_tokens, n_heads);
                let idx_len = lens[1].unwrap_or_else(|| wrapped_len(&[t, topk, 4], 0));
                indices.resize(idx_len / 4, -1);
                MlaCase {
                    layout,
                    lens: [
                        lens[0].unwrap_or_else(|| wrapped_len(&[t, h, layout.d_qk(), 2], 0)),
                        idx_len,
                        lens[2].unwrap_or_else(|| wrapped_len(&[t, h, layout.nope_dim(), 2], 0)),
                        lens[3].unwrap_or_else(|| wrapped_len(&[t, h, 4], 0)),
                    ],
                    n_tokens,
                    n_heads,
                    topk,
                    softmax_scale,
                    indices,
                    pages,
                    seed,
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn copy_pages_hostile(c in copy_case()) {
        exercise(&c)?;
    }

    #[test]
    fn page_checksums_hostile(c in checksum_case()) {
        exercise(&c)?;
    }

    #[test]
    fn stores_hostile(c in store_case()) {
        exercise(&c)?;
    }

    #[test]
    fn indexer_logits_hostile(c in indexer_case()) {
        exercise(&c)?;
    }

    #[test]
    fn topk_hostile(c in topk_case()) {
        exercise(&c)?;
    }

    #[test]
    fn sparse_mla_hostile(c in mla_case()) {
        exercise(&c)?;
    }
}

/// The strategies reach both sides: for every op, a fair share of the generated calls is
/// accepted (and judged against the reference) and a fair share rejected.
#[test]
fn hostile_calls_are_both_accepted_and_rejected() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;

    fn count<C: Case, S: Strategy<Value = C>>(name: &str, s: S) {
        let mut runner = TestRunner::deterministic();
        let cpu = CpuBackend::new();
        let (mut ok, mut rejected) = (0, 0);
        for _ in 0..300 {
            let c = s.new_tree(&mut runner).unwrap().current();
            let (inputs, outputs) = c.buffers();
            let ins: Vec<_> = inputs.iter().map(|x| cpu.upload(x).unwrap()).collect();
            let mut outs: Vec<_> = outputs.iter().map(|x| cpu.upload(x).unwrap()).collect();
            match c.call(&cpu, &ins, &mut outs) {
                Ok(()) => ok += 1,
                Err(_) => rejected += 1,
            }
        }
        eprintln!("{name}: {ok} accepted, {rejected} rejected of 300");
        assert!(
            ok >= 30 && rejected >= 30,
            "{name}: {ok} accepted, {rejected} rejected"
        );
    }
    count("copy_pages", copy_case());
    count("page_checksums", checksum_case());
    count("stores", store_case());
    count("indexer_logits", indexer_case());
    count("topk", topk_case());
    count("sparse_mla", mla_case());
}

/// Runs `c` on both backends and requires a typed rejection (besides everything
/// [`exercise_on`] checks).
fn rejected<C: Case>(c: &C) {
    exercise(c).unwrap();
    for name in ["cpu", "emu"] {
        let (inputs, outputs) = c.buffers();
        let result = if name == "cpu" {
            let b = CpuBackend::new();
            let ins: Vec<_> = inputs.iter().map(|x| b.upload(x).unwrap()).collect();
            let mut outs: Vec<_> = outputs.iter().map(|x| b.upload(x).unwrap()).collect();
            c.call(&b, &ins, &mut outs)
        } else {
            let b = EmuBackend::new();
            let ins: Vec<_> = inputs.iter().map(|x| b.upload(x).unwrap()).collect();
            let mut outs: Vec<_> = outputs.iter().map(|x| b.upload(x).unwrap()).collect();
            c.call(&b, &ins, &mut outs)
        };
        let e = result.expect_err(&format!("{name} accepted {c:?}"));
        assert_eq!(e.kind(), ErrorKind::Op, "{name}: {e}");
    }
}

/// The calls of issue 8 that passed the unchecked validation (wrapped sizes matching
/// small buffers): each is a typed error on both backends, nothing written.
#[test]
fn the_reported_wrapping_calls_are_rejected() {
    let bf16_index: PageLayout = index_layouts()[1].into(); // 128-byte pages
    let page = bf16_index.bytes_per_page();
    let contiguous = |n| PagedRegion::contiguous(bf16_index, n);
    // copy_pages to offset usize::MAX - 99: the region "ends" at page - 100 + ...
    let dst = PagedRegion {
        offset: usize::MAX - 99,
        ..contiguous(1)
    };
    rejected(&CopyCase {
        src: contiguous(1),
        src_len: page,
        dst_len: region_len(&dst, 0),
        dst,
        src_ids: vec![0],
        dst_ids: vec![0],
    });
    // A source stride of 2^63 over 3 pages wraps to a 1-page region.
    let src = PagedRegion {
        stride: 1 << 63,
        ..contiguous(3)
    };
    rejected(&CopyCase {
        src_len: region_len(&src, 0),
        src,
        dst: contiguous(3),
        dst_len: 3 * page,
        src_ids: vec![2],
        dst_ids: vec![0],
    });
    // Checksums of a page of a region at a wrapped offset.
    let region = PagedRegion {
        offset: usize::MAX - 27,
        ..contiguous(1)
    };
    rejected(&ChecksumCase {
        pool_len: region_len(&region, 0),
        region,
        ids: vec![0],
        out_len: 8,
    });
    // Top-k with k = 2^62 + 1: one row's output "is" 4 bytes.
    rejected(&TopkCase {
        k: (1 << 62) + 1,
        row_stride: 8,
        rows: Rows::Explicit(vec![QueryRange {
            request: 0,
            start: 0,
            end: 8,
        }]),
        slots: None,
        lens: [32, wrapped_len(&[1, (1 << 62) + 1, 4], 0)],
        seed: 1,
    });
    // The indexer with row_stride 2^62 + 16: each logits row "is" 64 bytes.
    let layout = index_layouts()[0];
    let row_stride = (1usize << 62) + 16;
    rejected(&IndexerCase {
        layout,
        n_heads: 2,
        table: vec![0, 1],
        max_pages: 2,
        rows: Rows::Explicit(vec![QueryRange {
            request: 0,
            start: 0,
            end: 6,
        }]),
        row_stride,
        pages: 2,
        lens: [2 * 16 * 2, 2 * 4, wrapped_len(&[1, row_stride, 4], 0)],
        seed: 2,
    });
    // Decode rows whose count overflows.
    rejected(&IndexerCase {
        layout,
        n_heads: 1,
        table: vec![0, 1],
        max_pages: 2,
        rows: Rows::Decode {
            context_lens: vec![u32::MAX, u32::MAX],
            next_n: usize::MAX,
        },
        row_stride: 8,
        pages: 2,
        lens: [0, 0, 0],
        seed: 3,
    });
}
