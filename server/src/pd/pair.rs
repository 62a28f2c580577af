//! A prefill/decode pair in one process (`serve --role both --pd on`, the harness's PD-on
//! configurations): a [`PrefillNode`] and a [`DecodeNode`] joined by the in-process
//! transport ([`crate::transfer::local`]). Each node copies its PD counters into its own
//! engine's metrics (`sparsekit_transfer_bytes_total{kind}`,
//! `sparsekit_refused_frames_total{reason}`, `sparsekit_refused_total{reason="pd_*"}`,
//! `sparsekit_quarantined_pages{pool="pd"}`, `sparsekit_pd_transfers_in_flight{side}`).

use std::sync::{Arc, Weak};
use std::time::Duration;

use sparsekit_host::{Backend, ModelOps};

use crate::engine::ModelConfig;
use crate::engine::{Engine, EngineOptions};
use crate::error::EngineError;
use crate::metrics::Metrics;
use crate::pd::decode::{Connector, DecodeNode, PeerLink};
use crate::pd::error::PdError;
use crate::pd::faults::{PdFault, StaleWriteBarrier};
use crate::pd::prefill::PrefillNode;
use crate::pd::stats::PdStatsSnapshot;
use crate::pd::PdOptions;
use crate::transfer::{local, TransferError, Transport};

/// Both nodes of an in-process PD pair (see the module docs).
pub struct PdPair<B: Backend + 'static> {
    pub prefill: Arc<Engine>,
    pub decode: Arc<Engine>,
    // Drop order: decode first.
    decode_node: DecodeNode<B>,
    prefill_node: Arc<PrefillNode<B>>,
}

impl<B: Backend + 'static> std::fmt::Debug for PdPair<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PdPair")
            .field("prefill", &self.prefill)
            .field("decode", &self.decode)
            .finish()
    }
}

/// Connects decode to the in-process `prefill`: a local transport pair whose prefill end
/// `prefill` serves.
fn local_connector<B: Backend + ModelOps + 'static>(prefill: Weak<PrefillNode<B>>) -> Connector {
    Arc::new(move |zone, decode_hello| {
        let p = prefill.upgrade().ok_or_else(|| {
            PdError::Transfer(TransferError::Closed("the prefill node stopped".into()))
        })?;
        let (d_end, p_end) = local::pair(zone.clone(), decode_hello.clone(), p.hello())?;
        let d_end: Arc<dyn Transport> = d_end;
        p.attach(p_end)
            .map_err(|e| PdError::Invalid(e.to_string()))?;
        Ok(d_end)
    })
}

impl<B: Backend + ModelOps + 'static> PdPair<B> {
    /// Starts a prefill engine (`prefill_opts`, its cache: prefix reuse and host tier as
    /// configured) and a decode engine (`decode_opts`, no prefix reuse: every prompt page
    /// arrives by transfer) on `backend`, joined by the in-process transport. PD faults
    /// that live in the decode cache are added to `decode_opts`' cache faults.
    pub fn start_local(
        backend: Arc<B>,
        cfg: ModelConfig,
        prefill_opts: EngineOptions,
        decode_opts: EngineOptions,
        pd: PdOptions,
        prefill_metrics: Arc<Metrics>,
        decode_metrics: Arc<Metrics>,
    ) -> Result<Self, EngineError> {
        let stale_write = pd
            .faults
            .active(PdFault::StaleTransferWrite)
            .then(|| Arc::new(StaleWriteBarrier::new()));
        let prefill_node = Arc::new(PrefillNode::start(
            backend.clone(),
            cfg,
            prefill_opts,
            &pd,
            prefill_metrics,
            stale_write.clone(),
        )?);
        let decode_node = DecodeNode::start(
            backend,
            cfg,
            decode_opts,
            &pd,
            decode_metrics,
            PeerLink {
                connector: local_connector(Arc::downgrade(&prefill_node)),
                connect_wait: Duration::ZERO,
            },
            stale_write,
        )?;
        Ok(PdPair {
            prefill: prefill_node.engine.clone(),
            decode: decode_node.engine.clone(),
            prefill_node,
            decode_node,
        })
    }
}

impl<B: Backend + 'static> PdPair<B> {
    /// Decode's transfers not ended yet.
    pub fn transfers_in_flight(&self) -> usize {
        self.decode_node.transfers_in_flight()
    }

    /// Pages decode holds for aborted transfers until prefill confirms.
    pub fn quarantined_pages(&self) -> usize {
        self.decode_node.quarantined_pages()
    }

    /// The endpoints' counters (decode's receiver, prefill's sender).
    pub fn stats(&self) -> (PdStatsSnapshot, PdStatsSnapshot) {
        (self.decode_node.stats(), self.prefill_node.stats())
    }

    /// Stops both engines (up to `grace` each for what is in flight), the prefill
    /// workers and the metrics threads.
    pub fn shutdown(self, grace: Duration) -> Result<(), EngineError> {
        let PdPair {
            decode_node,
            prefill_node,
            ..
        } = self;
        let d = decode_node.shutdown(grace);
        let p = prefill_node.shutdown(grace);
        d.and(p)
    }
}
