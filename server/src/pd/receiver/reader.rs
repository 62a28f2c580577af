//! The receiver's reader thread: every message prefill sends, checked before anything
//! reaches the cache (see the parent module's docs), the landing of written pages, the ends
//! of transfers, the quarantine ticks.

use super::*;

/// The reader thread: [`RxShared::run`] under [`crate::pd::stats::supervise`] (a panic
/// fails the request whose message was being handled and restarts it).
pub(super) fn supervise<B: Backend + 'static>(sh: &Arc<RxShared<B>>) {
    crate::pd::stats::supervise(
        "decode",
        &sh.stats,
        &sh.handling,
        &sh.shutdown,
        || sh.run(),
        |req| {
            let mut out = Outbox::new();
            {
                let mut st = sh.state.lock();
                sh.begin_abort(
                    &mut st,
                    req,
                    Outcome::Failed("the PD reader panicked handling it".into()),
                    &mut out,
                );
            }
            sh.flush(out);
        },
    )
}

impl<B: Backend + 'static> RxShared<B> {
    pub(super) fn send(&self, m: &Message) -> Result<(), PdError> {
        let f = m.encode()?;
        self.transport.send(&f)?;
        Ok(())
    }

    /// Sends what the handlers queued (a failed send surfaces as a closed connection).
    pub(super) fn flush(&self, out: Outbox) {
        for m in out {
            if let Err(e) = self.send(&m) {
                tracing::warn!(error = %e, message = m.name(), "PD send failed");
            }
        }
    }

    fn refuse(&self, reason: &'static str, req: Option<u64>, detail: &dyn std::fmt::Display) {
        self.stats.refuse(reason);
        tracing::warn!(reason, request = ?req, %detail, "PD decode refused a message");
    }

    fn run(&self) {
        let mut last_tick = Instant::now();
        loop {
            if self.shutdown.load(Ordering::Acquire) {
                return;
            }
            match self.transport.recv(self.config.tick) {
                Ok(Some(frame)) => self.handle(&frame),
                Ok(None) => {}
                Err(e) => {
                    let mut st = self.state.lock();
                    self.teardown(&mut st, &e.to_string());
                    return;
                }
            }
            // Deadlines are scanned once per tick, not once per frame.
            if last_tick.elapsed() >= self.config.tick {
                last_tick = Instant::now();
                self.tick();
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
        let mut out = Outbox::new();
        let job = {
            let mut st = self.state.lock();
            self.dispatch(&mut st, msg, &mut out)
        };
        // A layer lands outside the state lock: the copy may wait (bounded) for the
        // cache's layer lock, and nothing else of the receiver waits behind it.
        if let Some(job) = job {
            let result = self.land(&job);
            let mut st = self.state.lock();
            self.landed(&mut st, job, result, &mut out);
        }
        *self.handling.lock() = None;
        self.flush(out);
    }

    /// Handles `msg`; a valid write notification comes back as the pages to land.
    fn dispatch(&self, st: &mut RxState<B>, msg: Message, out: &mut Outbox) -> Option<LandJob<B>> {
        let req = msg.request();
        if !msg.valid_towards(Role::Decode) {
            self.refuse("wrong_direction", req, &msg.name());
            return None;
        }
        match msg {
            Message::Hello(_) => self.refuse("unexpected_hello", None, &"second handshake"),
            Message::Written(w) => return self.on_written(st, w, out),
            Message::Finished { req, tokens } => self.on_finished(st, req, tokens),
            Message::Cancelled { req, reason } => {
                self.on_confirmation(st, req, Outcome::Cancelled(reason))
            }
            Message::Abort { req, reason } => self.on_confirmation(
                st,
                req,
                Outcome::Cancelled(format!("prefill aborted: {reason}")),
            ),
            Message::Bootstrap(_) => self.refuse("wrong_direction", req, &"bootstrap"),
            Message::Pending { reqs } => {
                // Requests that ended meanwhile (or were never ours) are skipped: a
                // heartbeat only ever extends a live transfer's stall bound.
                let now = Instant::now();
                for r in reqs {
                    if let Some(t) = st.transfers.get_mut(&r) {
                        if matches!(t.phase, Phase::Active) {
                            t.progress = now;
                        }
                    }
                }
            }
        }
        None
    }

    /// Refusal reason for a message about a request without a live transfer.
    fn missing(&self, st: &RxState<B>, req: u64, what: &str) {
        if st.ended.contains_key(&req) {
            self.refuse(
                "ended",
                Some(req),
                &format!("{what} after the transfer ended"),
            );
        } else {
            self.refuse("unknown_request", Some(req), &what);
        }
    }

    /// Validates a write notification; the pages to land when it is acceptable.
    fn on_written(&self, st: &mut RxState<B>, w: Written, out: &mut Outbox) -> Option<LandJob<B>> {
        let req = w.req;
        let spec = *self.cache.spec();
        let Some(t) = st.transfers.get_mut(&req) else {
            self.missing(st, req, "write notification");
            return None;
        };
        if let Phase::Aborting { .. } = t.phase {
            self.refuse("after_abort", Some(req), &"late write after abort");
            return None;
        }
        let layer = w.layer as usize;
        if layer >= spec.num_layers {
            self.refuse(
                "bad_request",
                Some(req),
                &format!("layer {layer} of {}", spec.num_layers),
            );
            return None;
        }
        let want = spec.layout(w.kind).fingerprint();
        if self.config.checks.fingerprints && w.fingerprint != want {
            self.refuse(
                "layout_mismatch",
                Some(req),
                &format!(
                    "{} pages framed with layout {:#018x}, ours is {want:#018x}",
                    w.kind.name(),
                    w.fingerprint
                ),
            );
            self.begin_abort(
                st,
                req,
                Outcome::Failed(format!("{} layout mismatch", w.kind.name())),
                out,
            );
            return None;
        }
        let n = t.targets.len();
        let k = kind_index(w.kind);
        let mut seen = HashSet::new();
        for p in &w.pages {
            let refused = match t.index.get(&p.id) {
                None => Some((
                    "not_target",
                    format!("page {} is not a target of the transfer", p.id),
                )),
                Some(&i) if t.targets[i].generation != p.generation => Some((
                    "stale_generation",
                    format!(
                        "page {} generation {} (the transfer's is {})",
                        p.id, p.generation, t.targets[i].generation
                    ),
                )),
                Some(&i) if !seen.insert(i) || t.landed[layer * n + i][k] => Some((
                    "duplicate",
                    format!("page {} of layer {layer} {} again", p.id, w.kind.name()),
                )),
                Some(_) => None,
            };
            if let Some((reason, detail)) = refused {
                self.refuse(reason, Some(req), &detail);
                return None;
            }
        }
        let tail = t.targets.last().and_then(|last| {
            let i = w.pages.iter().position(|p| p.id == last.id)?;
            Some((i, spec.tail_spans(w.kind, t.prompt_tokens)?))
        });
        Some(LandJob {
            req,
            layer,
            kind: w.kind,
            pages: w.pages,
            checksums: w.checksums,
            tail,
            inbound: t.inbound.clone(),
        })
    }

    /// Applies the outcome of landing `job` (the transfer may have ended meanwhile).
    fn landed(
        &self,
        st: &mut RxState<B>,
        job: LandJob<B>,
        result: Result<usize, PdError>,
        out: &mut Outbox,
    ) {
        let (req, layer) = (job.req, job.layer);
        let Some(t) = st.transfers.get_mut(&req) else {
            return;
        };
        let (n, k) = (t.targets.len(), kind_index(job.kind));
        match result {
            Ok(bytes) => {
                self.stats.bytes(job.kind, bytes);
                for p in &job.pages {
                    if let Some(&i) = t.index.get(&p.id) {
                        t.landed[layer * n + i][k] = true;
                    }
                }
                t.progress = Instant::now();
                if t.finished_at.is_some() && self.all_published(t) {
                    self.complete(st, req);
                }
            }
            Err(PdError::Cache(HostError::StalePage { .. })) => {
                self.refuse(
                    "stale_generation",
                    Some(req),
                    &"the cache refused a stale page",
                );
                if !self.cache.is_live(req) {
                    // The decode request ended (failed, or served without waiting for
                    // its pages): nothing will read this transfer; stop it, keeping the
                    // pages quarantined until prefill confirms.
                    self.begin_abort(
                        st,
                        req,
                        Outcome::Cancelled("the decode request ended".into()),
                        out,
                    );
                }
            }
            Err(PdError::Cache(e @ HostError::Integrity { .. })) => {
                self.refuse("checksum", Some(req), &e);
                self.begin_abort(
                    st,
                    req,
                    Outcome::Failed(format!("refused landed bytes: {e}")),
                    out,
                );
            }
            Err(e) => {
                self.refuse("cache_refused", Some(req), &e);
                self.begin_abort(st, req, Outcome::Failed(e.to_string()), out);
            }
        }
    }

    /// Copies the landed pages into the cache through the transfer's inbound (generation
    /// and checksum checks there), holding only that transfer's lock. Returns the bytes
    /// copied.
    fn land(&self, job: &LandJob<B>) -> Result<usize, PdError> {
        let (layer, kind, pages) = (job.layer, job.kind, &job.pages);
        let ids: Vec<u32> = pages.iter().map(|p| p.id).collect();
        let b = self.cache.backend();
        let mut bytes = self.landing.read_pages(layer, kind, &ids)?;
        let region = PagedRegion::contiguous(self.cache.spec().layout(kind), pages.len());
        if let Some((i, spans)) = &job.tail {
            // Only the entries' bytes of a partly filled last page were sent: the rest of
            // the landing page is whatever an earlier transfer left there.
            let page = region.layout.bytes_per_page();
            if let Some(one) = bytes.get_mut(i * page..(i + 1) * page) {
                zero_outside(one, spans);
            }
        }
        let buf = b.upload(&bytes)?;
        let src_ids: Vec<i32> = (0..pages.len() as i32).collect();
        // Checks off: trust whatever landed (its own checksums always match).
        let sums = if self.config.checks.checksums {
            job.checksums.clone()
        } else {
            checksums(b, region, &buf, &src_ids)?
        };
        let mut inbound = job.inbound.lock();
        let Some(inbound) = inbound.as_mut() else {
            return Err(PdError::Invalid(
                "the transfer ended while its pages landed".into(),
            ));
        };
        inbound.write(layer, kind, pages, &buf, region, &src_ids, &sums)?;
        Ok(bytes.len())
    }

    fn all_published(&self, t: &Transfer<B>) -> bool {
        published(&self.cache, t)
    }

    fn on_finished(&self, st: &mut RxState<B>, req: u64, tokens: u32) {
        let Some(t) = st.transfers.get_mut(&req) else {
            return self.missing(st, req, "finished");
        };
        match t.phase {
            // Our abort crossed prefill's end: nothing more lands either way.
            Phase::Aborting { ref outcome, .. } => {
                let o = outcome.clone();
                self.end(st, req, o)
            }
            Phase::Active if t.finished_at.is_some() => {
                self.refuse("duplicate", Some(req), &"second finished")
            }
            Phase::Active if tokens as usize != t.prompt_tokens => {
                let detail = format!(
                    "prefill finished {tokens} tokens of a {}-token prompt",
                    t.prompt_tokens
                );
                self.refuse("bad_request", Some(req), &detail);
                // Prefill says nothing more lands: release at once.
                let _ = self.cache.abort(req);
                self.end(st, req, Outcome::Failed(detail));
            }
            Phase::Active => {
                t.finished_at = Some(Instant::now());
                if self.all_published(t) {
                    self.complete(st, req);
                }
            }
        }
    }

    /// Prefill says nothing more will land for `req` (`Cancelled`, or its own `Abort`).
    fn on_confirmation(&self, st: &mut RxState<B>, req: u64, peer: Outcome) {
        let Some(t) = st.transfers.get(&req) else {
            return self.missing(st, req, "cancellation");
        };
        let outcome = match &t.phase {
            Phase::Aborting { outcome, .. } => outcome.clone(),
            Phase::Active => {
                // Prefill gave up on its own: the request cannot be served.
                let _ = self.cache.abort(req);
                peer
            }
        };
        self.end(st, req, outcome);
    }

    /// Aborts an active transfer: the cache request is aborted (readers fail, references go
    /// stale; the inbound keeps the pages pinned) and prefill is asked to stop.
    pub(super) fn begin_abort(
        &self,
        st: &mut RxState<B>,
        req: u64,
        outcome: Outcome,
        out: &mut Outbox,
    ) {
        let Some(t) = st.transfers.get_mut(&req) else {
            return;
        };
        if !matches!(t.phase, Phase::Active) {
            return;
        }
        let reason = match &outcome {
            Outcome::Cancelled(r) | Outcome::Failed(r) => r.clone(),
            Outcome::Ready => String::new(),
        };
        t.phase = Phase::Aborting {
            since: Instant::now(),
            outcome,
        };
        let _ = self.cache.abort(req);
        tracing::info!(request = req, %reason, "PD transfer aborted; pages quarantined until prefill confirms");
        out.push(Message::Abort {
            req,
            reason: crate::pd::wire::fit_reason(reason),
        });
        self.changed.notify_all();
    }

    /// Every layer published and prefill finished: the transfer completes.
    fn complete(&self, st: &mut RxState<B>, req: u64) {
        self.end(st, req, Outcome::Ready);
    }

    /// Ends a transfer for good: its inbound ends (pins released), the outcome is kept.
    pub(super) fn end(&self, st: &mut RxState<B>, req: u64, outcome: Outcome) {
        let Some(t) = st.transfers.remove(&req) else {
            return;
        };
        let inbound = t.inbound.lock().take();
        let outcome = match (outcome, inbound) {
            (Outcome::Ready, Some(i)) => match i.complete() {
                Ok(()) => Outcome::Ready,
                Err(e) => Outcome::Failed(e.to_string()),
            },
            (o, i) => {
                let e = match &o {
                    Outcome::Cancelled(r) => HostError::Cancelled(r.clone()),
                    _ => HostError::Cancelled(format!("PD transfer failed: {o:?}")),
                };
                if let Some(i) = i {
                    i.fail(e);
                }
                o
            }
        };
        self.record_end(st, req, outcome);
    }

    /// Counts an ended transfer and remembers its outcome.
    fn record_end(&self, st: &mut RxState<B>, req: u64, outcome: Outcome) {
        self.stats.ended(match outcome {
            Outcome::Ready => Ended::Finished,
            Outcome::Cancelled(_) => Ended::Cancelled,
            Outcome::Failed(_) => Ended::Failed,
        });
        st.ended.insert(req, outcome);
        st.ended_order.push_back(req);
        while st.ended_order.len() > self.config.remember_ended {
            if let Some(old) = st.ended_order.pop_front() {
                if !st.transfers.contains_key(&old) {
                    st.ended.remove(&old);
                }
            }
        }
        self.changed.notify_all();
    }

    /// The connection is gone: every transfer ends. Where a write the peer posted before
    /// may still land ([`Transport::late_write_bound`]), the transfers' target pages stay
    /// quarantined for that bound before they can be reused.
    pub(super) fn teardown(&self, st: &mut RxState<B>, why: &str) {
        if st.closed.is_none() {
            st.closed = Some(why.to_owned());
            tracing::warn!(%why, transfers = st.transfers.len(), "PD connection to prefill closed");
        }
        let bound = self.transport.late_write_bound();
        let mut held = Vec::new();
        let reqs: Vec<u64> = st.transfers.keys().copied().collect();
        for req in reqs {
            let outcome = match st.transfers.get(&req).map(|t| &t.phase) {
                Some(Phase::Aborting { outcome, .. }) => outcome.clone(),
                _ => {
                    let _ = self.cache.abort(req);
                    Outcome::Failed(format!("connection closed: {why}"))
                }
            };
            if bound.is_zero() {
                self.end(st, req, outcome);
            } else if let Some(t) = self.end_keep_pinned(st, req, outcome) {
                held.push(t);
            }
        }
        if !held.is_empty() {
            // A timer, not a synchronisation: the pins go when no posted write can land.
            let spawned = std::thread::Builder::new()
                .name("sparsekit-pd-quarantine".into())
                .spawn(move || {
                    std::thread::sleep(bound);
                    drop(held);
                });
            if let Err(e) = spawned {
                tracing::error!("PD quarantine timer: {e}; releasing at once");
            }
        }
        self.changed.notify_all();
    }

    /// [`Self::end`] for a transfer whose bytes may still land: its readers fail now, its
    /// inbound (with the pins) is returned to be dropped later.
    fn end_keep_pinned(
        &self,
        st: &mut RxState<B>,
        req: u64,
        outcome: Outcome,
    ) -> Option<Inbound<B>> {
        let t = st.transfers.remove(&req)?;
        let mut inbound = t.inbound.lock().take()?;
        let e = HostError::Cancelled(format!("PD transfer failed: {outcome:?}"));
        inbound.fail_keep_pinned(e);
        self.record_end(st, req, outcome);
        Some(inbound)
    }

    /// Deadlines and orphans: transfers whose decode request ended, finished transfers
    /// whose notifications never came, stalled transfers, unconfirmed aborts.
    fn tick(&self) {
        let now = Instant::now();
        let c = &self.config;
        let mut out = Outbox::new();
        let mut close = None;
        {
            let mut st = self.state.lock();
            let mut late_finish = Vec::new();
            let mut stalled = Vec::new();
            let mut overdue = Vec::new();
            let mut orphaned = Vec::new();
            for (&req, t) in &st.transfers {
                match &t.phase {
                    Phase::Active => {
                        if !self.cache.is_live(req) {
                            orphaned.push(req);
                        } else if t.finished_at.is_some_and(|f| now - f > c.finish_grace) {
                            late_finish.push(req);
                        } else if now - t.started > c.transfer_timeout {
                            overdue.push(req);
                        } else if now - t.progress > c.stall_timeout {
                            stalled.push(req);
                        }
                    }
                    Phase::Aborting { since, .. } => {
                        if now - *since > c.confirm_timeout {
                            close = Some(req);
                        }
                    }
                }
            }
            for req in late_finish {
                self.refuse("missing_layers", Some(req), &"finished with layers missing");
                let _ = self.cache.abort(req);
                self.end(
                    &mut st,
                    req,
                    Outcome::Failed("prefill finished with layers missing".into()),
                );
            }
            for req in orphaned {
                // The decode request ended while its transfer was in flight (failed, or
                // served without waiting for its pages): nothing will read what lands.
                // Stop prefill now rather than at its next write, which may be a whole
                // prompt's compute away; the pages stay quarantined until it confirms.
                self.begin_abort(
                    &mut st,
                    req,
                    Outcome::Cancelled("the decode request ended".into()),
                    &mut out,
                );
            }
            for req in stalled {
                self.begin_abort(
                    &mut st,
                    req,
                    Outcome::Failed(format!("no progress for {:?}", c.stall_timeout)),
                    &mut out,
                );
            }
            for req in overdue {
                self.begin_abort(
                    &mut st,
                    req,
                    Outcome::Failed(format!("not done within {:?}", c.transfer_timeout)),
                    &mut out,
                );
            }
        }
        self.flush(out);
        if let Some(req) = close {
            let why = format!("prefill did not confirm the abort of request {req}");
            tracing::error!(%why, "tearing the PD connection down");
            self.transport.close(&why);
        }
    }
}
