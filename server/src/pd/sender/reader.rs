//! The sender's reader thread: decode's bootstraps (checked, queued as jobs), aborts,
//! the heartbeat, and the copies of a partly filled last page (see the parent module's
//! docs).

use super::*;

/// The reader thread: [`TxShared::run`] under [`crate::pd::stats::supervise`] (a panic
/// fails the request whose message was being handled and restarts it).
pub(super) fn supervise<B: Backend + 'static>(sh: &Arc<TxShared<B>>) {
    crate::pd::stats::supervise(
        "prefill",
        &sh.stats,
        &sh.handling,
        &sh.shutdown,
        || sh.run(),
        |req| sh.fail_request(req, "the prefill PD reader panicked handling it"),
    )
}

impl<B: Backend + 'static> TxShared<B> {
    pub(super) fn send(&self, m: &Message) -> Result<(), PdError> {
        let f = m.encode()?;
        self.transport.send(&f)?;
        Ok(())
    }

    fn send_logged(&self, m: &Message) {
        if let Err(e) = self.send(m) {
            tracing::warn!(error = %e, message = m.name(), "PD send failed");
        }
    }

    fn refuse(&self, reason: &'static str, req: Option<u64>, detail: &dyn std::fmt::Display) {
        self.stats.refuse(reason);
        tracing::warn!(reason, request = ?req, %detail, "PD prefill refused a message");
    }

    fn run(&self) {
        let mut beat = Beat {
            last: Instant::now(),
            liveness: None,
        };
        loop {
            if self.shutdown.load(Ordering::Acquire) {
                return;
            }
            self.heartbeat(&mut beat);
            match self.transport.recv(self.config.tick) {
                Ok(Some(frame)) => self.handle(&frame),
                Ok(None) => {}
                Err(e) => {
                    self.teardown(&e.to_string());
                    return;
                }
            }
        }
    }

    fn handle(&self, frame: &[u8]) {
        let msg = match decode_frame(frame) {
            Ok(m) => m,
            Err(e) => return self.refuse(e.reason(), None, &e),
        };
        *self.handling.lock() = msg.request();
        if let Some(h) = &self.config.hook {
            h(&msg);
        }
        let req = msg.request();
        if !msg.valid_towards(Role::Prefill) {
            self.refuse("wrong_direction", req, &msg.name());
        } else {
            match msg {
                Message::Bootstrap(b) => self.on_bootstrap(b),
                Message::Abort { req, reason } => self.on_abort(req, &reason),
                Message::Hello(_) => self.refuse("unexpected_hello", None, &"second handshake"),
                m => self.refuse("wrong_direction", req, &m.name()),
            }
        }
        *self.handling.lock() = None;
    }

    fn on_bootstrap(&self, b: Bootstrap) {
        let req = b.req;
        let spec = self.cache.spec();
        let refuse = |reason: &'static str, detail: String| {
            self.refuse(reason, Some(req), &detail);
            self.send_logged(&Message::Abort {
                req,
                reason: fit_reason(format!("bootstrap refused: {detail}")),
            });
        };
        if (b.kv_fingerprint, b.index_k_fingerprint)
            != (spec.kv.fingerprint(), spec.index_k.fingerprint())
        {
            return refuse(
                "layout_mismatch",
                format!(
                    "layouts kv {:#018x} / index-K {:#018x}, ours {:#018x} / {:#018x}",
                    b.kv_fingerprint,
                    b.index_k_fingerprint,
                    spec.kv.fingerprint(),
                    spec.index_k.fingerprint()
                ),
            );
        }
        let need = b.prompt.len().div_ceil(spec.page_size());
        if b.pages.len() != need {
            return refuse(
                "bad_request",
                format!(
                    "{} pages for {} tokens ({need} needed)",
                    b.pages.len(),
                    b.prompt.len()
                ),
            );
        }
        let mut ids = HashSet::new();
        for p in &b.pages {
            if p.id as usize >= self.geometry.num_pages() {
                return refuse(
                    "bad_request",
                    format!(
                        "page {} outside the {}-page landing zone",
                        p.id,
                        self.geometry.num_pages()
                    ),
                );
            }
            if !ids.insert(p.id) {
                return refuse("bad_request", format!("page {} named twice", p.id));
            }
        }
        let core = {
            let mut jobs = self.jobs.lock();
            if jobs.contains_key(&req) {
                drop(jobs);
                return self.refuse("duplicate", Some(req), &"bootstrap for a live transfer");
            }
            if jobs.len() >= self.config.max_jobs {
                drop(jobs);
                return refuse(
                    "overloaded",
                    format!("{} transfers in flight already", self.config.max_jobs),
                );
            }
            let core = Arc::new(JobCore {
                req,
                prompt: b.prompt,
                dest: b.pages,
                cancel: AtomicBool::new(false),
                cancel_reason: Mutex::new(String::new()),
                state: Mutex::new(JobState {
                    written: vec![false; spec.num_layers],
                    ..JobState::default()
                }),
            });
            jobs.insert(req, core.clone());
            core
        };
        self.stats.started();
        if self.queue_tx.send(core).is_err() {
            self.fail_request(req, "the prefill job queue is closed");
        }
    }

    fn on_abort(&self, req: u64, reason: &str) {
        let core = self.jobs.lock().get(&req).cloned();
        let Some(core) = core else {
            // Nothing is in flight for it: confirm, so decode can release its pages.
            self.refuse("unknown_request", Some(req), &"abort");
            return self.send_logged(&Message::Cancelled {
                req,
                reason: "no transfer in flight".into(),
            });
        };
        *core.cancel_reason.lock() = reason.to_owned();
        if self.config.faults.active(PdFault::StaleTransferWrite) {
            // The bug: confirm at once while the job keeps writing.
            let mut st = core.state.lock();
            if !st.ended {
                st.ended = true;
                st.zombie = true;
                self.jobs.lock().remove(&req);
                self.stats.ended(Ended::Cancelled);
                self.send_logged(&Message::Cancelled {
                    req,
                    reason: fit_reason(reason.to_owned()),
                });
            }
            return;
        }
        core.cancel.store(true, Ordering::Release);
        // With the write lock held no write of the job is in flight, and none follows.
        let locked = core.state.try_lock_for(self.config.abort_wait);
        if let Some(mut st) = locked {
            self.confirm_cancelled(&core, &mut st);
        }
    }

    /// Sends `Cancelled` for a job decode asked to stop (once).
    fn confirm_cancelled(&self, core: &JobCore, st: &mut JobState) {
        if st.ended {
            return;
        }
        st.ended = true;
        self.jobs.lock().remove(&core.req);
        self.stats.ended(Ended::Cancelled);
        let reason = core.cancel_reason.lock().clone();
        self.send_logged(&Message::Cancelled {
            req: core.req,
            reason: fit_reason(reason),
        });
    }

    /// Prefill gives `req` up: no more writes; decode is told with an `Abort`.
    fn fail_request(&self, req: u64, why: &str) {
        let core = self.jobs.lock().get(&req).cloned();
        match core {
            Some(core) => {
                core.cancel.store(true, Ordering::Release);
                if let Some(mut st) = core.state.try_lock_for(self.config.abort_wait) {
                    self.end_job(&core, &mut st, why);
                }
            }
            None => self.send_logged(&Message::Abort {
                req,
                reason: fit_reason(why.to_owned()),
            }),
        }
    }

    /// Prefill advanced (a job taken, a layer written, a job ended).
    pub(super) fn advance(&self) {
        *self.advanced.lock() = Instant::now();
    }

    /// Every `heartbeat`: while prefill advances, tells decode which transfers are still
    /// pending (queued or being computed), so that waiting behind other prompts is not
    /// mistaken for a stall.
    fn heartbeat(&self, beat: &mut Beat) {
        let now = Instant::now();
        if now.duration_since(beat.last) < self.config.heartbeat {
            return;
        }
        beat.last = now;
        if let Some(probe) = &self.config.liveness {
            let v = probe();
            if beat.liveness.is_some_and(|old| old != v) {
                self.advance();
            }
            beat.liveness = Some(v);
        }
        if now.duration_since(*self.advanced.lock()) > self.config.quiet_limit {
            return;
        }
        let reqs: Vec<u64> = self.jobs.lock().keys().copied().collect();
        for chunk in reqs.chunks(MAX_PENDING) {
            self.send_logged(&Message::Pending {
                reqs: chunk.to_vec(),
            });
        }
    }

    /// Ends a job that did not finish: `Cancelled` if decode asked, else `Abort`.
    pub(super) fn end_job(&self, core: &JobCore, st: &mut JobState, why: &str) {
        if st.ended {
            return;
        }
        self.advance();
        if core.cancel.load(Ordering::Acquire) && !core.cancel_reason.lock().is_empty() {
            return self.confirm_cancelled(core, st);
        }
        st.ended = true;
        self.jobs.lock().remove(&core.req);
        self.stats.ended(Ended::Failed);
        self.send_logged(&Message::Abort {
            req: core.req,
            reason: fit_reason(why.to_owned()),
        });
    }

    /// The connection is gone: every job ends without a message (none can be sent).
    pub(super) fn teardown(&self, why: &str) {
        {
            let mut c = self.closed.lock();
            if c.is_none() {
                *c = Some(why.to_owned());
                tracing::warn!(%why, "PD connection to decode closed");
            }
        }
        let jobs: Vec<Arc<JobCore>> = self.jobs.lock().drain().map(|(_, c)| c).collect();
        for core in jobs {
            core.cancel.store(true, Ordering::Release);
            if let Some(mut st) = core.state.try_lock_for(self.config.abort_wait) {
                if !st.ended {
                    st.ended = true;
                    self.stats.ended(Ended::Cancelled);
                }
            }
        }
        self.late.lock().clear();
    }

    /// The byte ranges of a `tokens`-token transfer's last page that its copy moves for
    /// pool `kind` framed as `layout` (`None`: the page is full, it moves whole). Under
    /// `model1-scales-as-interleaved` a model1_fp8 page is taken for token-interleaved
    /// (each token's 584 bytes one after the other): the rows move, the tile scales at the
    /// page's end do not.
    pub(super) fn tail_copy(
        &self,
        kind: BufferKind,
        layout: PageLayout,
        tokens: usize,
    ) -> Option<Vec<std::ops::Range<usize>>> {
        let entries = self.cache.spec().tail_entries(kind, tokens)?;
        match layout {
            PageLayout::Kv(kv)
                if kv.dtype() == KvDtype::Model1Fp8
                    && self
                        .config
                        .faults
                        .active(PdFault::Model1ScalesAsInterleaved) =>
            {
                let end = (entries * kv.bytes_per_token()).min(layout.bytes_per_page());
                Some(std::iter::once(0..end).collect())
            }
            _ => Some(layout.entry_spans(entries)),
        }
    }

    /// Where and how `kind` pages are framed: the layout, and the region of `layer` in
    /// decode's landing zone. Under `pd-fp8-frame`, index-K uses the fp8 layout of the same
    /// shape (its page size and stride; the region's base stays where decode put it).
    pub(super) fn framing(&self, layer: usize, kind: BufferKind) -> (PageLayout, PagedRegion) {
        let spec = self.cache.spec();
        let region = self.geometry.region(layer, kind);
        if kind == BufferKind::IndexK && self.config.faults.active(PdFault::Fp8Frame) {
            if let Ok(fp8) = IndexKLayout::new(
                IndexKDtype::FP8,
                spec.index_k.head_dim(),
                spec.index_k.page_size(),
            ) {
                let l = PageLayout::from(fp8);
                return (
                    l,
                    PagedRegion {
                        layout: l,
                        stride: l.bytes_per_page(),
                        ..region
                    },
                );
            }
        }
        (region.layout, region)
    }
}
