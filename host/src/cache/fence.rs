//! Layer fences and ready tokens: no layer's buffers are read before that layer has
//! landed. A [`LayerFence`] belongs to one load (or is complete from the start when nothing
//! is loaded); [`LayerFence::wait`] is the only way to obtain a [`ReadyToken`], and the
//! device pool hands out a layer's KV and index-K views only against a token for that
//! layer ([`super::DevicePool::kv`], [`super::DevicePool::index_k`]).

use std::marker::PhantomData;
use std::sync::{Arc, RwLockReadGuard};

use super::faults::{Fault, Faults};
use super::pool::{BufferKind, DevicePool, LayerBuffers};
use crate::backend::Backend;
use crate::error::{Error, Result};

mod sync {
    pub use std::sync::{Condvar, Mutex};
}
#[path = "fence_core.rs"]
mod core;

/// Readiness of every layer of one load.
#[derive(Clone, Debug)]
pub struct LayerFence {
    core: Arc<core::FenceCore<Error>>,
    num_layers: usize,
}

impl LayerFence {
    /// A fence whose layers land later (the io worker publishes them).
    pub fn pending(num_layers: usize) -> Self {
        LayerFence {
            core: Arc::new(core::FenceCore::new(num_layers)),
            num_layers,
        }
    }

    /// A fence with every layer already landed (nothing to load).
    pub fn complete(num_layers: usize) -> Self {
        let f = Self::pending(num_layers);
        for l in 0..num_layers {
            f.core.publish(l);
        }
        f
    }

    /// Layer `layer`'s bytes are in place (the io worker calls this after writing them).
    pub(crate) fn publish(&self, layer: usize) {
        self.core.publish(layer)
    }

    /// The load failed; every waiter gets `e`.
    pub(crate) fn fail(&self, e: Error) {
        self.core.fail(e)
    }

    /// Waits until `layer` has landed.
    pub fn wait(&self, layer: usize) -> Result<ReadyToken<'_>> {
        if layer >= self.num_layers {
            return Err(Error::invalid(
                "layer",
                format!("{layer} of {}", self.num_layers),
            ));
        }
        self.core.wait(layer)?;
        Ok(ReadyToken {
            layer,
            _fence: PhantomData,
        })
    }

    /// Waits for every layer (the whole load).
    pub fn wait_all(&self) -> Result<()> {
        for l in 0..self.num_layers {
            self.wait(l)?;
        }
        Ok(())
    }

    /// Whether every layer landed, without blocking.
    pub fn is_complete(&self) -> bool {
        self.core.is_complete()
    }
}

/// The fences of every load one forward step depends on.
#[derive(Clone, Debug)]
pub struct LoadGroup {
    fences: Vec<LayerFence>,
    num_layers: usize,
}

impl LoadGroup {
    /// A group over `fences` of a `num_layers`-layer cache.
    pub fn new(fences: Vec<LayerFence>, num_layers: usize) -> Self {
        LoadGroup { fences, num_layers }
    }

    /// Adds the fences of another group (several requests in one batch).
    pub fn extend(&mut self, other: &LoadGroup) {
        self.fences.extend(other.fences.iter().cloned());
    }

    /// Waits until `layer` has landed in every load of the group.
    pub fn wait(&self, layer: usize) -> Result<ReadyToken<'_>> {
        if layer >= self.num_layers {
            return Err(Error::invalid(
                "layer",
                format!("{layer} of {}", self.num_layers),
            ));
        }
        for f in &self.fences {
            f.wait(layer)?;
        }
        Ok(ReadyToken {
            layer,
            _fence: PhantomData,
        })
    }

    /// Waits for every layer of every load.
    pub fn wait_all(&self) -> Result<()> {
        for l in 0..self.num_layers {
            self.wait(l)?;
        }
        Ok(())
    }
}

/// Proof that a layer has landed. Only [`LayerFence::wait`] and [`LoadGroup::wait`]
/// make one; it borrows the fence (group) it came from.
#[derive(Debug)]
pub struct ReadyToken<'f> {
    layer: usize,
    _fence: PhantomData<&'f LayerFence>,
}

impl ReadyToken<'_> {
    pub fn layer(&self) -> usize {
        self.layer
    }
}

/// Read access to one buffer of one layer.
#[derive(Debug)]
pub struct BufferView<'a, B: Backend> {
    guard: RwLockReadGuard<'a, LayerBuffers<B>>,
    kind: BufferKind,
}

impl<B: Backend> BufferView<'_, B> {
    pub fn buffer(&self) -> &B::Buffer {
        self.guard.get(self.kind)
    }
}

impl<B: Backend> DevicePool<B> {
    /// The KV buffer of the token's layer.
    pub fn kv(&self, token: &ReadyToken<'_>) -> Result<BufferView<'_, B>> {
        Ok(BufferView {
            guard: self.read(token.layer)?,
            kind: BufferKind::Kv,
        })
    }

    /// The index-K buffer of the token's layer.
    pub fn index_k(&self, token: &ReadyToken<'_>) -> Result<BufferView<'_, B>> {
        Ok(BufferView {
            guard: self.read(token.layer)?,
            kind: BufferKind::IndexK,
        })
    }

    /// The index-K buffer of `layer` **without** waiting: exists only for the
    /// `skip-index-wait` fault injection and fails unless that fault is active.
    pub fn index_k_unfenced(&self, layer: usize, faults: &Faults) -> Result<BufferView<'_, B>> {
        if !faults.active(Fault::SkipIndexWait) {
            return Err(Error::invalid(
                "index_k_unfenced",
                "reading a layer without its ready token is a fault injection only",
            ));
        }
        Ok(BufferView {
            guard: self.read(layer)?,
            kind: BufferKind::IndexK,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_returns_after_publish_and_failure_wakes_everyone() {
        let f = LayerFence::pending(3);
        assert!(!f.is_complete());
        f.publish(0);
        assert_eq!(f.wait(0).unwrap().layer(), 0);
        let g = f.clone();
        // A waiter blocked on layer 2 is woken by the failure.
        let waiter = std::thread::spawn(move || g.wait(2).map(|t| t.layer()));
        std::thread::sleep(std::time::Duration::from_millis(20));
        f.fail(Error::Cancelled("io".into()));
        assert!(matches!(waiter.join().unwrap(), Err(Error::Cancelled(_))));
        assert!(
            matches!(f.wait(0), Err(Error::Cancelled(_))),
            "failure wins"
        );
        assert!(f.wait(3).is_err());
        assert!(LayerFence::complete(2).is_complete());
        assert!(LayerFence::complete(2).wait_all().is_ok());
    }
}
