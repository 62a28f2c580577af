//! One transfer on prefill's side: staging a layer's pages, pushing them to decode,
//! confirming the end (see the parent module's docs).

use super::*;

impl<B: Backend + 'static> Job<B> {
    /// Decode's request id.
    pub fn request(&self) -> u64 {
        self.core.req
    }

    /// The prompt whose KV is to be pushed.
    pub fn prompt(&self) -> &[u32] {
        &self.core.prompt
    }

    /// Decode's destination pages (token order).
    pub fn destination(&self) -> &[PageRef] {
        &self.core.dest
    }

    /// Whether decode asked to stop (or the connection is gone): stop computing and drop
    /// or [`Job::cancel`] the job.
    pub fn is_cancelled(&self) -> bool {
        self.core.cancel.load(Ordering::Acquire) || self.core.state.lock().ended
    }

    /// Copies this layer's source pages `src` (prefill's pages of the request, token order,
    /// one per destination page) of both kinds out of the layer `guard` of the sender's
    /// cache, with their checksums. Hold the guard only for this call.
    pub fn stage(
        &self,
        guard: &LayerGuard<'_, B>,
        src: &[PageRef],
    ) -> Result<StagedLayer, PdError> {
        if src.len() != self.core.dest.len() {
            return Err(PdError::Invalid(format!(
                "{} source pages for {} destination pages",
                src.len(),
                self.core.dest.len()
            )));
        }
        let cache = &self.shared.cache;
        // Only pages the guard's step holds, written for their generation in this layer
        // (every pool holding an entry of the prompt, with at least its entries).
        guard.check_pages(src, self.core.prompt.len())?;
        let ids: Vec<i32> = src.iter().map(|p| p.id as i32).collect();
        let b = cache.backend();
        let layer = guard.layer();
        let mut pools = Vec::new();
        let spec = cache.spec();
        let tokens = self.core.prompt.len();
        for kind in spec.kinds(layer) {
            let view = guard.view(kind, &[])?;
            let tail = spec.tail_spans(kind, tokens);
            // Every page of every pool, but of the window pool only the pages decode's
            // queries read (the last window's).
            let sent: Vec<usize> = spec.carried_pages(kind, tokens).collect();
            // The pages' places in this pool (a window pool's frames).
            let sent_ids: Vec<i32> = sent.iter().map(|&i| ids[i]).collect();
            let at = guard.buffer_pages(kind, &sent_ids);
            if let Some(i) = at.iter().position(|&a| a < 0) {
                return Err(PdError::Invalid(format!(
                    "page {} gave its {} rows back, and decode reads them",
                    sent_ids[i],
                    kind.name()
                )));
            }
            let staged = stage(b, cache.device_region(kind), view, &at, tail.as_deref())?;
            pools.push((kind, sent, staged));
        }
        Ok(StagedLayer { layer, pools })
    }

    /// Pushes a staged layer to decode: every pool's bytes into its landing zone, each
    /// followed by its notification. Refused once the job is cancelled or ended.
    pub fn write(&self, staged: StagedLayer) -> Result<(), PdError> {
        let sh = &*self.shared;
        let core = &*self.core;
        // `stale-transfer-write` in a pair: a decoy's first write waits (outside the write
        // lock, which the reader takes to answer decode's abort) until decode aborted it.
        let decoy = sh.config.faults.active(PdFault::StaleTransferWrite)
            && sh
                .config
                .stale_barrier
                .as_ref()
                .is_some_and(|b| b.writes_in_flight(core.req, DECOY_WAIT));
        let mut st = core.state.lock();
        if core.cancel.load(Ordering::Acquire) {
            sh.confirm_or_end(core, &mut st);
            return Err(self.cancelled());
        }
        if st.ended && !st.zombie {
            return Err(self.cancelled());
        }
        let layer = staged.layer;
        if layer >= st.written.len() {
            return Err(PdError::Invalid(format!("layer {layer}")));
        }
        for (kind, sent, pages) in staged.pools.iter().map(|(k, i, p)| (*k, i, p)) {
            let (layout, region) = sh.framing(layer, kind);
            let page = layout.bytes_per_page();
            let dest: Vec<PageRef> = sent
                .iter()
                .filter_map(|&i| core.dest.get(i))
                .copied()
                .collect();
            let mut segments = Vec::with_capacity(dest.len() + 1);
            let tail = sh.tail_copy(kind, layout, core.prompt.len());
            for (i, p) in dest.iter().enumerate() {
                let bytes = pages.bytes.get(i * page..(i + 1) * page).ok_or_else(|| {
                    PdError::Invalid(format!("staged {} pages too short", kind.name()))
                })?;
                let at = region.page_range(p.id as usize).start;
                match &tail {
                    // A partly filled last page: only its entries' bytes travel.
                    Some(spans) if i + 1 == dest.len() => {
                        for r in spans {
                            segments.push(Segment {
                                offset: at + r.start,
                                bytes: &bytes[r.clone()],
                            });
                        }
                    }
                    _ => segments.push(Segment { offset: at, bytes }),
                }
            }
            let note = Message::Written(Written {
                req: core.req,
                layer: layer as u32,
                kind,
                fingerprint: layout.fingerprint(),
                pages: dest.clone(),
                checksums: pages.checksums.clone(),
            })
            .encode()?;
            if st.zombie {
                sh.hold_late(layer, kind, &dest, &segments, note);
                continue;
            }
            sh.push(layer, kind, &dest, &segments, &note)?;
            sh.stats
                .bytes(kind, segments.iter().map(|s| s.bytes.len()).sum());
        }
        st.written[layer] = true;
        sh.advance();
        if decoy && st.zombie && st.written.iter().all(|w| *w) {
            if let Some(b) = &sh.config.stale_barrier {
                b.all_held(core.req);
            }
        }
        Ok(())
    }

    /// [`Job::stage`] then [`Job::write`] (the guard is held while writing: use the two
    /// calls to release it before the write).
    pub fn send_layer(&self, guard: &LayerGuard<'_, B>, src: &[PageRef]) -> Result<(), PdError> {
        let s = self.stage(guard, src)?;
        self.write(s)
    }

    /// Pushes every layer of request `req` of the sender's cache (its pages `src`), one
    /// step over the request, each layer staged under its guard and written after the guard
    /// is released. Stops with `Cancelled` as soon as decode asks.
    pub fn send_all(&self, req: RequestId, src: &[PageRef]) -> Result<(), PdError> {
        let cache = self.shared.cache.clone();
        let mut step = cache.step(&[req])?;
        for l in 0..cache.spec().num_layers {
            if self.core.cancel.load(Ordering::Acquire) {
                return Err(self.cancelled());
            }
            let staged = {
                let g = step.wait_layer(l)?;
                self.stage(&g, src)?
            };
            self.write(staged)?;
        }
        Ok(())
    }

    /// Confirms the end to decode: every layer was pushed and nothing more will land.
    pub fn finish(mut self) -> Result<(), PdError> {
        self.done = true;
        let sh = &*self.shared;
        let core = &*self.core;
        let mut st = core.state.lock();
        if core.cancel.load(Ordering::Acquire) {
            sh.confirm_or_end(core, &mut st);
            return Err(self.cancelled());
        }
        if st.ended {
            return Err(self.cancelled());
        }
        if let Some(l) = st.written.iter().position(|w| !w) {
            sh.end_job(core, &mut st, &format!("prefill did not push layer {l}"));
            return Err(PdError::Invalid(format!(
                "finish with layer {l} not pushed (the transfer was aborted)"
            )));
        }
        st.ended = true;
        sh.jobs.lock().remove(&core.req);
        sh.advance();
        let m = Message::Finished {
            req: core.req,
            tokens: core.prompt.len() as u32,
        };
        let r = sh.send(&m);
        sh.stats.ended(if r.is_ok() {
            Ended::Finished
        } else {
            Ended::Failed
        });
        r
    }

    /// Prefill gives the request up (decode is told; after a decode abort, this is the
    /// confirmation).
    pub fn cancel(mut self, reason: &str) {
        self.done = true;
        let mut st = self.core.state.lock();
        self.shared.end_job(&self.core, &mut st, reason);
    }

    fn cancelled(&self) -> PdError {
        let reason = self.core.cancel_reason.lock().clone();
        PdError::Cancelled {
            req: self.core.req,
            reason: if reason.is_empty() {
                "the transfer ended".into()
            } else {
                reason
            },
        }
    }
}

impl<B: Backend + 'static> Drop for Job<B> {
    fn drop(&mut self) {
        if !self.done {
            let why = if std::thread::panicking() {
                "the prefill worker failed"
            } else {
                "the prefill job was dropped"
            };
            let mut st = self.core.state.lock();
            self.shared.end_job(&self.core, &mut st, why);
        }
    }
}

impl<B: Backend + 'static> TxShared<B> {
    /// A cancelled job's owner touched it: confirm now if the reader could not.
    fn confirm_or_end(&self, core: &JobCore, st: &mut JobState) {
        self.end_job(core, st, "cancelled");
    }

    /// One kind of one layer to decode: the bytes, then the notification — with, under
    /// `stale-transfer-write`, any held late write to the same pages landing in between.
    fn push(
        &self,
        layer: usize,
        kind: BufferKind,
        dest: &[PageRef],
        segments: &[Segment<'_>],
        note: &[u8],
    ) -> Result<(), PdError> {
        let late = self.take_late(layer, kind, dest);
        if late.is_empty() {
            self.transport.write(segments, Some(note))?;
            return Ok(());
        }
        self.transport.write(segments, None)?;
        for w in late {
            let segs: Vec<Segment<'_>> = w
                .segments
                .iter()
                .map(|(offset, bytes)| Segment {
                    offset: *offset,
                    bytes,
                })
                .collect();
            tracing::warn!(
                layer,
                kind = kind.name(),
                "stale-transfer-write: late write lands"
            );
            self.transport.write(&segs, Some(&w.notification))?;
        }
        self.transport.send(note)?;
        Ok(())
    }

    fn hold_late(
        &self,
        layer: usize,
        kind: BufferKind,
        dest: &[PageRef],
        segments: &[Segment<'_>],
        notification: Vec<u8>,
    ) {
        let mut late = self.late.lock();
        late.push_back(LateWrite {
            layer,
            kind,
            pages: dest.iter().map(|p| p.id).collect(),
            segments: segments
                .iter()
                .map(|s| (s.offset, s.bytes.to_vec()))
                .collect(),
            notification,
        });
        while late.len() > self.config.max_late {
            late.pop_front();
        }
    }

    fn take_late(&self, layer: usize, kind: BufferKind, dest: &[PageRef]) -> Vec<LateWrite> {
        let mut late = self.late.lock();
        if late.is_empty() {
            return Vec::new();
        }
        let (hit, keep): (Vec<LateWrite>, Vec<LateWrite>) = late.drain(..).partition(|w| {
            w.layer == layer && w.kind == kind && dest.iter().any(|p| w.pages.contains(&p.id))
        });
        late.extend(keep);
        hit
    }
}
