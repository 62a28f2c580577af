//! The suite must fail when a backend is wrong. A wrapper backend injects one fault at a
//! time into the CPU backend's results; each fault must turn its op's records to `fail`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use sparsekit_host::cpu::topk::select_row;
use sparsekit_host::cpu::CpuBuffer;
use sparsekit_host::ops::{
    CopyPages, IndexKStore, IndexerLogits, KvStore, Op, PageChecksums, SparseMla, Topk,
};
use sparsekit_host::{Backend, CpuBackend, Result};
use sparsekit_validation::{run, Check, Size, Status, SuiteConfig};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    /// One byte of the first stored token's index key flipped.
    IndexKByte,
    /// One byte of the last stored KV token's rope flipped.
    KvByte,
    /// Logits of the first row shifted one column to the right.
    IndexerShift,
    /// One logit left unwritten (NaN poison survives).
    IndexerUnwritten,
    /// Logits nudged by one ulp when more than one row is computed (batch-dependent).
    IndexerBatchDependent,
    /// Top-k ties broken towards the higher position in the first row.
    TopkTieOrder,
    /// Sparse MLA ignores each token's last valid slot.
    MlaDropsSlot,
    /// Sparse MLA lse off by 1e-3.
    MlaLse,
    /// DeepSeek-V4 attention without its sink.
    MlaV4IgnoresSink,
    /// The last page of a copy goes to the wrong destination page.
    CopyWrongPage,
    /// The checksum of the first page of a call is that of the page after it.
    ChecksumOffByOnePage,
}

#[derive(Debug)]
struct Faulty {
    cpu: CpuBackend,
    fault: Fault,
}

impl Backend for Faulty {
    type Buffer = CpuBuffer;
    fn name(&self) -> &str {
        "faulty"
    }
    fn upload(&self, b: &[u8]) -> Result<CpuBuffer> {
        self.cpu.upload(b)
    }
    fn alloc(&self, n: usize) -> Result<CpuBuffer> {
        self.cpu.alloc(n)
    }
    fn alloc_host(&self, n: usize) -> Result<CpuBuffer> {
        self.cpu.alloc_host(n)
    }
    fn download(&self, b: &CpuBuffer) -> Result<Vec<u8>> {
        self.cpu.download(b)
    }
    fn buffer_len(&self, b: &CpuBuffer) -> usize {
        b.len()
    }
    fn index_k_store(
        &self,
        op: &IndexKStore<'_>,
        keys: &CpuBuffer,
        cache: &mut CpuBuffer,
    ) -> Result<()> {
        self.cpu.index_k_store(op, keys, cache)?;
        if self.fault == Fault::IndexKByte {
            if let Some(&s) = op.slots.iter().find(|&&s| s >= 0) {
                let at = op.layout.slot_value_bytes(s as usize).start;
                cache.bytes_mut()[at] ^= 0x01;
            }
        }
        Ok(())
    }
    fn kv_store(&self, op: &KvStore<'_>, kv: &CpuBuffer, cache: &mut CpuBuffer) -> Result<()> {
        self.cpu.kv_store(op, kv, cache)?;
        if self.fault == Fault::KvByte {
            if let Some(&s) = op.slots.iter().rev().find(|&&s| s >= 0) {
                let l = op.layout;
                let at = l.slot_token_bytes(s as usize).start + l.rope_range().start;
                cache.bytes_mut()[at] ^= 0x01;
            }
        }
        Ok(())
    }
    fn indexer_logits(
        &self,
        op: &IndexerLogits<'_>,
        q: &CpuBuffer,
        w: &CpuBuffer,
        cache: &CpuBuffer,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        self.cpu.indexer_logits(op, q, w, cache, out)?;
        let stride = op.row_stride;
        let o = out.typed_mut::<f32>("logits")?;
        match self.fault {
            Fault::IndexerShift => o[..stride].rotate_right(1),
            Fault::IndexerUnwritten => {
                if let Some(r) = op.rows.iter().position(|r| r.end > r.start) {
                    o[r * stride + op.rows[r].start as usize] = f32::NAN;
                }
            }
            Fault::IndexerBatchDependent if op.rows.len() > 1 => {
                for x in o.iter_mut().filter(|x| x.is_finite() && **x != 0.0) {
                    *x = f32::from_bits(x.to_bits() + 1);
                }
            }
            _ => {}
        }
        Ok(())
    }
    fn topk(&self, op: &Topk<'_>, logits: &CpuBuffer, out: &mut CpuBuffer) -> Result<()> {
        self.cpu.topk(op, logits, out)?;
        if self.fault == Fault::TopkTieOrder {
            // Reselect every row preferring higher positions among ties (select on the
            // reversed row), then translate to what the CPU wrote (slots or positions).
            let l = logits.typed::<f32>("logits")?.to_vec();
            let cpu_out = out.typed_mut::<i32>("topk")?;
            for (r, range) in op.rows.iter().enumerate() {
                let row = &l[r * op.row_stride..][range.start as usize..range.end as usize];
                let mut rev: Vec<f32> = row.to_vec();
                rev.reverse();
                let mut dst = vec![-1i32; op.k];
                let n = select_row(&rev, op.k, &mut dst);
                let mut pos: Vec<i32> = dst[..n]
                    .iter()
                    .map(|&p| (rev.len() - 1) as i32 - p)
                    .collect();
                pos.sort_unstable();
                let mut plain = vec![-1i32; op.k];
                let m = select_row(row, op.k, &mut plain);
                let got = &mut cpu_out[r * op.k..(r + 1) * op.k];
                let map: std::collections::HashMap<i32, i32> = plain[..m]
                    .iter()
                    .zip(&got[..m])
                    .map(|(p, s)| (*p, *s))
                    .collect();
                // Positions not selected by the CPU have no slot: mark them invalid.
                for (i, p) in pos.iter().enumerate() {
                    got[i] = *map.get(p).unwrap_or(&(i32::MAX - 1));
                }
            }
        }
        Ok(())
    }
    fn sparse_mla(
        &self,
        op: &SparseMla,
        q: &CpuBuffer,
        cache: &CpuBuffer,
        indices: &CpuBuffer,
        out: &mut CpuBuffer,
        lse: &mut CpuBuffer,
    ) -> Result<()> {
        if self.fault == Fault::MlaDropsSlot {
            let mut idx: Vec<i32> = indices.typed::<i32>("indices")?.to_vec();
            for row in idx.chunks_mut(op.topk) {
                if let Some(last) = row.iter_mut().rev().find(|s| **s >= 0) {
                    *last = -1;
                }
            }
            let idx = CpuBuffer::from_bytes(bytemuck::cast_slice(&idx));
            return self.cpu.sparse_mla(op, q, cache, &idx, out, lse);
        }
        self.cpu.sparse_mla(op, q, cache, indices, out, lse)?;
        if self.fault == Fault::MlaLse {
            for x in lse
                .typed_mut::<f32>("lse")?
                .iter_mut()
                .filter(|x| x.is_finite())
            {
                *x += 1e-3;
            }
        }
        Ok(())
    }
    fn sparse_mla_v4(
        &self,
        op: &sparsekit_host::ops::SparseMlaV4<'_>,
        q: &CpuBuffer,
        main: sparsekit_host::KvInput<'_, CpuBuffer>,
        extra: Option<sparsekit_host::KvInput<'_, CpuBuffer>>,
        out: &mut CpuBuffer,
        lse: &mut CpuBuffer,
    ) -> Result<()> {
        if self.fault == Fault::MlaV4IgnoresSink {
            let op = sparsekit_host::ops::SparseMlaV4 {
                attn_sink: None,
                ..*op
            };
            return self.cpu.sparse_mla_v4(&op, q, main, extra, out, lse);
        }
        self.cpu.sparse_mla_v4(op, q, main, extra, out, lse)
    }
    fn copy_pages(&self, op: &CopyPages<'_>, src: &CpuBuffer, dst: &mut CpuBuffer) -> Result<()> {
        self.copy_fault(op, src, dst)
    }
    fn page_checksums(
        &self,
        op: &PageChecksums<'_>,
        pool: &CpuBuffer,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        if self.fault == Fault::ChecksumOffByOnePage && !op.ids.is_empty() {
            let mut ids = op.ids.to_vec();
            ids[0] = (ids[0] + 1) % op.region.num_pages as i32;
            return self
                .cpu
                .page_checksums(&PageChecksums { ids: &ids, ..*op }, pool, out);
        }
        self.cpu.page_checksums(op, pool, out)
    }
}

impl Faulty {
    fn copy_fault(&self, op: &CopyPages<'_>, src: &CpuBuffer, dst: &mut CpuBuffer) -> Result<()> {
        if self.fault != Fault::CopyWrongPage || op.dst_ids.len() < 2 {
            return self.cpu.copy_pages(op, src, dst);
        }
        let n = op.dst_ids.len();
        let mut ids = op.dst_ids.to_vec();
        ids[n - 1] = ids[n - 2];
        // Copy all but the last, then the last onto the second-to-last destination.
        self.cpu.copy_pages(
            &CopyPages {
                src_ids: &op.src_ids[..n - 1],
                dst_ids: &op.dst_ids[..n - 1],
                ..*op
            },
            src,
            dst,
        )?;
        self.cpu.copy_pages(
            &CopyPages {
                src_ids: &op.src_ids[n - 1..],
                dst_ids: &ids[n - 1..],
                ..*op
            },
            src,
            dst,
        )
    }
}

fn records(fault: Fault, op: Op) -> Vec<sparsekit_validation::Record> {
    let cfg = SuiteConfig {
        size: Size::Quick,
        seed: rand::random(),
        ops: vec![op],
    };
    let b = Faulty {
        cpu: CpuBackend::new(),
        fault,
    };
    run(&b, &cfg, |_| {})
}

fn assert_caught(fault: Fault, op: Op, check: Check) {
    let recs = records(fault, op);
    let caught = recs
        .iter()
        .filter(|r| r.check == check && r.status == Status::Fail)
        .count();
    assert!(
        caught > 0,
        "{fault:?} not caught by {check:?} checks of {}",
        op.name()
    );
}

#[test]
fn store_faults_are_caught() {
    assert_caught(Fault::IndexKByte, Op::IndexKStore, Check::Reference);
    assert_caught(Fault::KvByte, Op::KvStore, Check::Reference);
}

#[test]
fn indexer_faults_are_caught() {
    assert_caught(Fault::IndexerShift, Op::IndexerLogits, Check::Reference);
    assert_caught(Fault::IndexerUnwritten, Op::IndexerLogits, Check::Reference);
    assert_caught(
        Fault::IndexerBatchDependent,
        Op::IndexerLogits,
        Check::BatchInvariance,
    );
}

#[test]
fn topk_tie_order_is_caught() {
    assert_caught(Fault::TopkTieOrder, Op::Topk, Check::Reference);
}

#[test]
fn sparse_mla_faults_are_caught() {
    assert_caught(Fault::MlaDropsSlot, Op::SparseMla, Check::Reference);
    assert_caught(Fault::MlaLse, Op::SparseMla, Check::Reference);
}

#[test]
fn sparse_mla_v4_faults_are_caught() {
    assert_caught(Fault::MlaV4IgnoresSink, Op::SparseMlaV4, Check::Reference);
}

#[test]
fn page_faults_are_caught() {
    assert_caught(Fault::CopyWrongPage, Op::CopyPages, Check::Reference);
    assert_caught(
        Fault::ChecksumOffByOnePage,
        Op::PageChecksums,
        Check::Reference,
    );
}
