//! Typed-error checks: every caller mistake gets a typed error, and a rejected call writes
//! nothing (the output and cache buffers are byte-identical afterwards).

use half::bf16;
use sparsekit_host::layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout};
use sparsekit_host::ops::{
    CopyPages, IndexKStore, IndexerLogits, KvStore, Op, PageChecksums, PageTable, PagedRegion,
    QueryRange, SparseMla, Topk, TopkOutput,
};
use sparsekit_host::{Backend, Error};

use super::{ensure, Failure, Outcome};
use crate::fixtures::{self, bytes_of, case_rng};
use crate::reference;
use crate::tolerance::{self, DataType, ErrorStats, Quantity};

/// Runs `f` on a buffer of `len` bytes of 0x5A and checks that it fails with an error
/// matching `pred` and leaves the buffer untouched.
fn rejected<B: Backend>(
    b: &B,
    what: &str,
    len: usize,
    f: impl FnOnce(&mut B::Buffer) -> Result<(), Error>,
    pred: impl Fn(&Error) -> bool,
) -> Outcome {
    let before = vec![0x5Au8; len];
    let mut buf = b.upload(&before)?;
    match f(&mut buf) {
        Ok(()) => return Err(Failure(format!("{what}: accepted, must be rejected"))),
        Err(e) => {
            ensure(pred(&e), || format!("{what}: unexpected error {e:?}"))?;
            ensure(!e.to_string().is_empty(), || {
                format!("{what}: empty message")
            })?;
        }
    }
    ensure(b.download(&buf)? == before, || {
        format!("{what}: the rejected call wrote")
    })
}

/// Stores and page ops: slots out of range, below -1 or duplicated; wrong key and cache
/// sizes; copies between different layouts (the historical fp8-vs-bf16 host row bug), bad
/// and duplicated page ids; checksums of a missing page or into a short output.
pub fn stores_and_pages<B: Backend>(b: &B) -> Outcome {
    let il = IndexKLayout::new(IndexKDtype::FP8, 64, 16)?;
    let kl = KvLayout::new(KvDtype::Fp8DsMla, 128, 32, 16)?;
    let keys = b.upload(bytes_of(&vec![bf16::ONE; 3 * 64]))?;
    let cache_len = il.buffer_bytes(2);
    for slots in [vec![0i64, 32, 1], vec![0, -2, 1], vec![4, 5, 4]] {
        let op = IndexKStore {
            layout: il,
            slots: &slots,
        };
        rejected(
            b,
            &format!("index_k_store slots {slots:?}"),
            cache_len,
            |c| b.index_k_store(&op, &keys, c),
            |e| {
                matches!(
                    e,
                    Error::SlotOutOfRange { .. } | Error::DuplicateSlot { .. }
                )
            },
        )?;
    }
    let op = IndexKStore {
        layout: il,
        slots: &[0, 1],
    };
    rejected(
        b,
        "index_k_store keys for 3 tokens, 2 slots",
        cache_len,
        |c| b.index_k_store(&op, &keys, c),
        |e| matches!(e, Error::BufferSize { what: "keys", .. }),
    )?;
    let op = IndexKStore {
        layout: il,
        slots: &[0, 1, 2],
    };
    rejected(
        b,
        "index_k_store cache not whole pages",
        cache_len + 3,
        |c| b.index_k_store(&op, &keys, c),
        |e| matches!(e, Error::BufferSize { .. }),
    )?;
    let kv = b.upload(bytes_of(&vec![bf16::ONE; 2 * 160]))?;
    let op = KvStore {
        layout: kl,
        slots: &[0, 99],
    };
    rejected(
        b,
        "kv_store slot past the cache",
        kl.buffer_bytes(2),
        |c| b.kv_store(&op, &kv, c),
        |e| matches!(e, Error::SlotOutOfRange { slot: 99, .. }),
    )?;

    let bf = IndexKLayout::new(IndexKDtype::Bf16, 64, 16)?;
    let src = b.upload(&vec![1u8; il.buffer_bytes(4)])?;
    let op = CopyPages {
        src: PagedRegion::contiguous(il, 4),
        dst: PagedRegion::contiguous(bf, 4),
        src_ids: &[0],
        dst_ids: &[1],
    };
    rejected(
        b,
        "copy_pages fp8 → bf16 pool",
        bf.buffer_bytes(4),
        |d| b.copy_pages(&op, &src, d),
        |e| matches!(e, Error::LayoutMismatch { .. }),
    )?;
    let op = CopyPages {
        dst: PagedRegion::contiguous(il, 4),
        src_ids: &[0, 7],
        dst_ids: &[1, 2],
        ..op
    };
    rejected(
        b,
        "copy_pages source page past the pool",
        il.buffer_bytes(4),
        |d| b.copy_pages(&op, &src, d),
        |e| matches!(e, Error::PageOutOfRange { page: 7, .. }),
    )?;
    let op = CopyPages {
        src_ids: &[0, 1],
        dst_ids: &[2, 2],
        ..op
    };
    rejected(
        b,
        "copy_pages duplicate destination",
        il.buffer_bytes(4),
        |d| b.copy_pages(&op, &src, d),
        |e| matches!(e, Error::DuplicatePage { .. }),
    )?;
    let op = PageChecksums {
        region: PagedRegion::contiguous(il, 4),
        ids: &[0, -1],
    };
    rejected(
        b,
        "page_checksums page -1",
        16,
        |o| b.page_checksums(&op, &src, o),
        |e| matches!(e, Error::PageOutOfRange { page: -1, .. }),
    )?;
    let op = PageChecksums { ids: &[0], ..op };
    rejected(
        b,
        "page_checksums output of two for one page",
        16,
        |o| b.page_checksums(&op, &src, o),
        |e| {
            matches!(
                e,
                Error::BufferSize {
                    what: "checksums",
                    ..
                }
            )
        },
    )
}

/// Indexer, top-k and attention inputs: unmapped pages, ranges past the row stride,
/// requests outside the page table, `k = 0`, backwards ranges, attention indices outside
/// the cache and a non-finite softmax scale.
pub fn attention_inputs<B: Backend>(b: &B) -> Outcome {
    let il = IndexKLayout::new(IndexKDtype::Bf16, 16, 4)?;
    let pages = [0, 1, -1];
    let pt = PageTable::new(&pages, 3)?;
    let cache = b.upload(&vec![0u8; il.buffer_bytes(2)])?;
    let q = b.upload(bytes_of(&[bf16::ONE; 2 * 16]))?;
    let w = b.upload(bytes_of(&[1f32, 1.0]))?;
    // Context 9 needs the unmapped third page.
    let op = IndexerLogits::decode(il, 2, pt, &[9], 1, 9)?;
    rejected(
        b,
        "indexer_logits unmapped page",
        9 * 4,
        |o| b.indexer_logits(&op, &q, &w, &cache, o),
        |e| matches!(e, Error::PageOutOfRange { page: -1, .. }),
    )?;
    let bad_rows = IndexerLogits {
        rows: vec![QueryRange {
            request: 0,
            start: 0,
            end: 8,
        }],
        row_stride: 7,
        ..op.clone()
    };
    rejected(
        b,
        "indexer_logits range past the row stride",
        7 * 4,
        |o| b.indexer_logits(&bad_rows, &q, &w, &cache, o),
        |e| matches!(e, Error::InvalidRange { .. }),
    )?;
    let bad_req = IndexerLogits {
        rows: vec![QueryRange {
            request: 1,
            start: 0,
            end: 4,
        }],
        row_stride: 8,
        ..op.clone()
    };
    rejected(
        b,
        "indexer_logits request outside the page table",
        8 * 4,
        |o| b.indexer_logits(&bad_req, &q, &w, &cache, o),
        |e| matches!(e, Error::InvalidRange { .. }),
    )?;
    ensure(
        matches!(
            IndexerLogits::decode(il, 2, pt, &[9, 1], 1, 9),
            Err(Error::Shape { .. })
        ),
        || "decode rows for 2 requests of a 1-request table accepted".into(),
    )?;

    let rows = [QueryRange {
        request: 0,
        start: 0,
        end: 4,
    }];
    let logits = b.upload(bytes_of(&[1f32, 2.0, 3.0, 4.0]))?;
    let op = Topk {
        short_rows: sparsekit_host::ops::ShortRows::SelectValid,
        k: 0,
        row_stride: 4,
        rows: &rows,
        output: TopkOutput::Positions,
    };
    rejected(
        b,
        "topk k = 0",
        0,
        |o| b.topk(&op, &logits, o),
        |e| matches!(e, Error::InvalidArgument { what: "k", .. }),
    )?;
    let back = [QueryRange {
        request: 0,
        start: 3,
        end: 1,
    }];
    let op = Topk {
        short_rows: sparsekit_host::ops::ShortRows::SelectValid,
        k: 2,
        rows: &back,
        ..op
    };
    rejected(
        b,
        "topk backwards range",
        8,
        |o| b.topk(&op, &logits, o),
        |e| matches!(e, Error::InvalidRange { .. }),
    )?;

    let kl = KvLayout::new(KvDtype::Bf16, 16, 16, 4)?;
    let kv = b.upload(&vec![0u8; kl.buffer_bytes(1)])?;
    let q = b.upload(bytes_of(&[bf16::ONE; 2 * 32]))?;
    let idx = b.upload(bytes_of(&[0i32, 4]))?;
    let op = SparseMla {
        layout: kl,
        n_tokens: 1,
        n_heads: 2,
        topk: 2,
        softmax_scale: 0.1,
    };
    let mut lse = b.upload(&[0x5A; 8])?;
    rejected(
        b,
        "sparse_mla index past the cache",
        2 * 16 * 2,
        |o| b.sparse_mla(&op, &q, &kv, &idx, o, &mut lse),
        |e| {
            matches!(
                e,
                Error::SlotOutOfRange {
                    what: "indices",
                    slot: 4,
                    ..
                }
            )
        },
    )?;
    let op = SparseMla {
        softmax_scale: f32::NAN,
        ..op
    };
    rejected(
        b,
        "sparse_mla NaN softmax scale",
        2 * 16 * 2,
        |o| b.sparse_mla(&op, &q, &kv, &idx, o, &mut lse),
        |e| matches!(e, Error::InvalidArgument { .. }),
    )?;
    ensure(b.download(&lse)? == vec![0x5A; 8], || {
        "rejected sparse_mla wrote lse".into()
    })
}

/// A layout the GPU kernels do not take (index-K `head_dim` 272, above the indexer
/// kernel's 256): a backend either rejects it with a typed error naming the op and writes
/// nothing, or computes it correctly (the CPU backend has no such limit).
pub fn shapes_past_the_kernels<B: Backend>(b: &B) -> Outcome {
    match wide_indexer(b)? {
        Some(e) => ensure(
            matches!(
                e,
                Error::InvalidArgument {
                    what: "indexer_logits",
                    ..
                }
            ),
            || format!("head_dim 272 rejected with {e:?}"),
        ),
        None => Ok(()),
    }
}

/// As [`shapes_past_the_kernels`], for backends that run the GPU kernels (emu, cuda):
/// the shape must be rejected.
pub fn gpu_kernel_limits<B: Backend>(b: &B) -> Outcome {
    match wide_indexer(b)? {
        Some(Error::InvalidArgument {
            what: "indexer_logits",
            ..
        }) => Ok(()),
        Some(e) => Err(Failure(format!("head_dim 272 rejected with {e:?}"))),
        None => Err(Failure(
            "head_dim 272 accepted by a backend whose indexer kernel stops at 256".into(),
        )),
    }
}

/// The indexer at head_dim 272: `Some(error)` when rejected (after checking that nothing
/// was written), `None` when computed (after checking it against the f64 reference).
fn wide_indexer<B: Backend>(b: &B) -> Result<Option<Error>, Failure> {
    let mut rng = case_rng(super::seed(), 0x272);
    let il = IndexKLayout::new(IndexKDtype::Bf16, 272, 4)?;
    let paging = fixtures::Paging::new(&mut rng, 4, &[6, 3], 1);
    let pool = fixtures::index_k_pool(&mut rng, &il, &paging);
    let pt = PageTable::new(&paging.table, paging.max_pages)?;
    let h = 2;
    let op = IndexerLogits::decode(il, h, pt, &paging.lens, 1, 7)?;
    let (q, w) = fixtures::indexer_inputs(&mut rng, op.rows.len(), h, 272);
    let poison = fixtures::poison_f32(op.rows.len() * 7);
    let mut out = b.upload(&poison)?;
    let cache = b.upload(&pool)?;
    match b.indexer_logits(
        &op,
        &b.upload(bytes_of(&q))?,
        &b.upload(bytes_of(&w))?,
        &cache,
        &mut out,
    ) {
        Err(e) => {
            ensure(b.download(&out)? == poison, || {
                "rejected indexer_logits wrote".into()
            })?;
            Ok(Some(e))
        }
        Ok(()) => {
            let got: Vec<f32> = bytemuck::pod_collect_to_vec(&b.download(&out)?);
            let want = reference::indexer_logits(&il, &pool, &pt, &op.rows, h, &q, &w, 7);
            let t = tolerance::get(Op::IndexerLogits, Quantity::Logits, DataType::Bf16)?;
            let mut stats = ErrorStats::default();
            for (i, g) in got.iter().enumerate() {
                stats.add(i, *g as f64, want.logits[i], want.magnitude[i], t);
            }
            ensure(stats.pass(), || {
                format!("head_dim 272 computed wrong: {stats:?}")
            })?;
            Ok(None)
        }
    }
}
