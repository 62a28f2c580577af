//! Layer fences and ready tokens. A [`Fence`] belongs to one load or one inbound transfer;
//! the io worker (or the transfer) publishes each layer after its bytes landed. Readers
//! never see a fence: a [`super::Step`] waits on the fences of its requests and mints a
//! [`ReadyToken`], bound to the cache, the step and the layer, that only the step itself
//! accepts in exchange for the layer's guard. There is no other way to a token.

use std::time::Instant;

use super::fence_core::{FenceCore, WaitError};
use crate::error::{Error, Result};

/// Readiness of every layer of one load or inbound transfer (crate-internal).
#[derive(Debug)]
pub(crate) struct Fence {
    core: FenceCore<Error>,
}

impl Fence {
    /// A fence whose layers land later.
    pub fn pending(num_layers: usize) -> Self {
        Fence {
            core: FenceCore::new(num_layers),
        }
    }

    /// Layer `layer`'s bytes are in place.
    pub fn publish(&self, layer: usize) {
        self.core.publish(layer)
    }

    /// The load failed; every waiter gets `e` (the first failure wins).
    pub fn fail(&self, e: Error) -> bool {
        self.core.fail(e)
    }

    /// Waits until `layer` landed, the load failed, or `deadline` passed.
    pub fn wait(&self, layer: usize, deadline: Instant, started: Instant) -> Result<()> {
        self.core.wait(layer, deadline).map_err(|e| match e {
            WaitError::Failed(e) => e,
            WaitError::TimedOut => Error::Timeout {
                what: "a layer's ready token",
                after: started.elapsed(),
            },
        })
    }

    /// Non-blocking: `Some(Ok)` landed, `Some(Err)` failed, `None` pending.
    pub fn poll(&self, layer: usize) -> Option<Result<()>> {
        self.core.poll(layer)
    }

    pub fn failure(&self) -> Option<Error> {
        self.core.failure()
    }

    pub fn is_complete(&self) -> bool {
        self.core.is_complete()
    }
}

/// Proof that one layer has landed for every request of one step. Minted only by
/// [`super::Step::wait`] (no public constructor, not `Clone`); accepted only by the step
/// that minted it ([`super::Step::layer`]), which checks cache, step and layer.
#[derive(Debug)]
pub struct ReadyToken {
    pub(crate) cache: u64,
    pub(crate) step: u64,
    pub(crate) layer: usize,
}

impl ReadyToken {
    /// The layer this token is for.
    pub fn layer(&self) -> usize {
        self.layer
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn wait_is_bounded_and_failure_wakes_everyone() {
        let f = Arc::new(Fence::pending(3));
        let now = Instant::now();
        f.publish(0);
        assert!(f.wait(0, now, now).is_ok());
        assert!(matches!(
            f.wait(1, now + Duration::from_millis(5), now),
            Err(Error::Timeout { .. })
        ));
        let g = f.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = std::thread::spawn(move || {
            tx.send(()).unwrap();
            let t = Instant::now();
            g.wait(2, t + Duration::from_secs(30), t)
        });
        rx.recv().unwrap();
        assert!(f.fail(Error::Cancelled("io".into())));
        assert!(
            !f.fail(Error::Cancelled("second".into())),
            "first failure wins"
        );
        assert!(matches!(waiter.join().unwrap(), Err(Error::Cancelled(m)) if m == "io"));
        assert!(
            matches!(f.wait(0, now, now), Err(Error::Cancelled(_))),
            "failure wins over a landed layer"
        );
        assert!(!f.is_complete());
    }
}
