//! Every caller mistake gets a typed error, and a rejected call writes nothing: the output
//! and cache buffers are byte-identical afterwards. Run on the CPU and emulator backends.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use half::bf16;
use sparsekit_host::layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout};
use sparsekit_host::ops::{
    CopyPages, IndexKStore, IndexerLogits, KvStore, PageChecksums, PageTable, PagedRegion,
    QueryRange, SparseMla, Topk, TopkOutput,
};
use sparsekit_host::{Backend, CpuBackend, EmuBackend, Error};

fn bytes<T: bytemuck::Pod>(v: &[T]) -> &[u8] {
    bytemuck::cast_slice(v)
}

/// Runs `f` on a buffer filled with 0x5A and asserts that it fails with an error matching
/// `pred` and leaves the buffer untouched.
fn rejected<B: Backend>(
    b: &B,
    len: usize,
    f: impl FnOnce(&mut B::Buffer) -> Result<(), Error>,
    pred: impl Fn(&Error) -> bool,
) {
    let before = vec![0x5Au8; len];
    let mut buf = b.upload(&before).unwrap();
    let err = f(&mut buf).expect_err("call must be rejected");
    assert!(pred(&err), "{}: unexpected error {err:?}", b.name());
    assert!(!err.to_string().is_empty());
    assert_eq!(
        b.download(&buf).unwrap(),
        before,
        "{}: rejected call wrote",
        b.name()
    );
}

fn stores_and_pages<B: Backend>(b: &B) {
    let il = IndexKLayout::new(IndexKDtype::FP8, 64, 16).unwrap();
    let kl = KvLayout::new(KvDtype::Fp8DsMla, 128, 32, 16).unwrap();
    let keys = b.upload(bytes(&vec![bf16::ONE; 3 * 64])).unwrap();
    let cache_len = il.buffer_bytes(2);
    // Slot past the end, below -1, duplicated; keys of the wrong size; a partial page.
    for (slots, ok_keys) in [
        (vec![0i64, 32, 1], true),
        (vec![0, -2, 1], true),
        (vec![4, 5, 4], true),
    ] {
        let op = IndexKStore {
            layout: il,
            slots: &slots,
        };
        rejected(
            b,
            cache_len,
            |c| b.index_k_store(&op, &keys, c),
            |e| {
                ok_keys
                    && matches!(
                        e,
                        Error::SlotOutOfRange { .. } | Error::DuplicateSlot { .. }
                    )
            },
        );
    }
    let op = IndexKStore {
        layout: il,
        slots: &[0, 1],
    };
    rejected(
        b,
        cache_len,
        |c| b.index_k_store(&op, &keys, c),
        |e| matches!(e, Error::BufferSize { what: "keys", .. }),
    );
    let op = IndexKStore {
        layout: il,
        slots: &[0, 1, 2],
    };
    rejected(
        b,
        cache_len + 3,
        |c| b.index_k_store(&op, &keys, c),
        |e| matches!(e, Error::BufferSize { .. }),
    );
    let kv = b.upload(bytes(&vec![bf16::ONE; 2 * 160])).unwrap();
    let op = KvStore {
        layout: kl,
        slots: &[0, 99],
    };
    rejected(
        b,
        kl.buffer_bytes(2),
        |c| b.kv_store(&op, &kv, c),
        |e| matches!(e, Error::SlotOutOfRange { slot: 99, .. }),
    );

    // Page copies: layout mismatch (the historical fp8-vs-bf16 host row bug), bad ids.
    let bf = IndexKLayout::new(IndexKDtype::Bf16, 64, 16).unwrap();
    let src = b.upload(&vec![1u8; il.buffer_bytes(4)]).unwrap();
    let op = CopyPages {
        src: PagedRegion::contiguous(il, 4),
        dst: PagedRegion::contiguous(bf, 4),
        src_ids: &[0],
        dst_ids: &[1],
    };
    rejected(
        b,
        bf.buffer_bytes(4),
        |d| b.copy_pages(&op, &src, d),
        |e| matches!(e, Error::LayoutMismatch { .. }),
    );
    let op = CopyPages {
        dst: PagedRegion::contiguous(il, 4),
        src_ids: &[0, 7],
        dst_ids: &[1, 2],
        ..op
    };
    rejected(
        b,
        il.buffer_bytes(4),
        |d| b.copy_pages(&op, &src, d),
        |e| matches!(e, Error::PageOutOfRange { page: 7, .. }),
    );
    let op = CopyPages {
        src_ids: &[0, 1],
        dst_ids: &[2, 2],
        ..op
    };
    rejected(
        b,
        il.buffer_bytes(4),
        |d| b.copy_pages(&op, &src, d),
        |e| matches!(e, Error::DuplicatePage { .. }),
    );
    let op = PageChecksums {
        region: PagedRegion::contiguous(il, 4),
        ids: &[0, -1],
    };
    rejected(
        b,
        16,
        |o| b.page_checksums(&op, &src, o),
        |e| matches!(e, Error::PageOutOfRange { page: -1, .. }),
    );
    let op = PageChecksums { ids: &[0], ..op };
    rejected(
        b,
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
    );
}

#[test]
fn cpu_rejects_bad_stores_and_page_ops() {
    stores_and_pages(&CpuBackend::new());
}

#[test]
fn emu_rejects_bad_stores_and_page_ops() {
    stores_and_pages(&EmuBackend::new());
}

#[test]
fn cpu_rejects_bad_attention_inputs() {
    let b = CpuBackend::new();
    let il = IndexKLayout::new(IndexKDtype::Bf16, 16, 4).unwrap();
    let pages = [0, 1, -1];
    let pt = PageTable::new(&pages, 3).unwrap();
    let cache = b.upload(&vec![0u8; il.buffer_bytes(2)]).unwrap();
    let q = b.upload(bytes(&[bf16::ONE; 2 * 16])).unwrap();
    let w = b.upload(bytes(&[1f32, 1.0])).unwrap();
    // Context 9 needs the unmapped third page.
    let op = IndexerLogits::decode(il, 2, pt, &[9], 1, 9).unwrap();
    rejected(
        &b,
        9 * 4,
        |o| b.indexer_logits(&op, &q, &w, &cache, o),
        |e| matches!(e, Error::PageOutOfRange { page: -1, .. }),
    );
    // Range past the row stride; request outside the page table.
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
        &b,
        7 * 4,
        |o| b.indexer_logits(&bad_rows, &q, &w, &cache, o),
        |e| matches!(e, Error::InvalidRange { .. }),
    );
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
        &b,
        8 * 4,
        |o| b.indexer_logits(&bad_req, &q, &w, &cache, o),
        |e| matches!(e, Error::InvalidRange { .. }),
    );
    assert!(matches!(
        IndexerLogits::decode(il, 2, pt, &[9, 1], 1, 9),
        Err(Error::Shape { .. })
    ));

    // Top-k: k = 0, start after end.
    let rows = [QueryRange {
        request: 0,
        start: 0,
        end: 4,
    }];
    let logits = b.upload(bytes(&[1f32, 2.0, 3.0, 4.0])).unwrap();
    let op = Topk {
        k: 0,
        row_stride: 4,
        rows: &rows,
        output: TopkOutput::Positions,
    };
    rejected(
        &b,
        0,
        |o| b.topk(&op, &logits, o),
        |e| matches!(e, Error::InvalidArgument { what: "k", .. }),
    );
    let back = [QueryRange {
        request: 0,
        start: 3,
        end: 1,
    }];
    let op = Topk {
        k: 2,
        rows: &back,
        ..op
    };
    rejected(
        &b,
        8,
        |o| b.topk(&op, &logits, o),
        |e| matches!(e, Error::InvalidRange { .. }),
    );

    // Sparse MLA: an index outside the cache, a non-finite scale.
    let kl = KvLayout::new(KvDtype::Bf16, 16, 16, 4).unwrap();
    let kv = b.upload(&vec![0u8; kl.buffer_bytes(1)]).unwrap();
    let q = b.upload(bytes(&[bf16::ONE; 2 * 32])).unwrap();
    let idx = b.upload(bytes(&[0i32, 4])).unwrap();
    let op = SparseMla {
        layout: kl,
        n_tokens: 1,
        n_heads: 2,
        topk: 2,
        softmax_scale: 0.1,
    };
    let mut lse = b.upload(&[0x5A; 8]).unwrap();
    rejected(
        &b,
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
    );
    let op = SparseMla {
        softmax_scale: f32::NAN,
        ..op
    };
    rejected(
        &b,
        2 * 16 * 2,
        |o| b.sparse_mla(&op, &q, &kv, &idx, o, &mut lse),
        |e| matches!(e, Error::InvalidArgument { .. }),
    );
    assert_eq!(b.download(&lse).unwrap(), vec![0x5A; 8]);
}

#[test]
fn emu_rejects_shapes_its_kernels_cannot_run() {
    let b = EmuBackend::new();
    // head_dim 272 is a valid layout but above the GPU indexer's 256.
    let il = IndexKLayout::new(IndexKDtype::Bf16, 272, 4).unwrap();
    let pages = [0];
    let pt = PageTable::new(&pages, 1).unwrap();
    let cache = b.upload(&vec![0u8; il.buffer_bytes(1)]).unwrap();
    let q = b.upload(bytes(&vec![bf16::ONE; 272])).unwrap();
    let w = b.upload(bytes(&[1f32])).unwrap();
    let op = IndexerLogits::decode(il, 1, pt, &[4], 1, 4).unwrap();
    rejected(
        &b,
        16,
        |o| b.indexer_logits(&op, &q, &w, &cache, o),
        |e| {
            matches!(
                e,
                Error::InvalidArgument {
                    what: "indexer_logits",
                    ..
                }
            )
        },
    );
}
