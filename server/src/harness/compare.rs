//! Judging a served session against its reference: a session is corrupted when any
//! generated token or any step's logits digest differs; the verdict names the first
//! diverging turn and step. A turn the server refused, aborted or never finished is not
//! corruption (it was detected or it wedged) and is counted apart.

use serde::Serialize;

use crate::harness::run::{SessionTrace, TurnFailure};

/// What differed first.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Divergence {
    /// The logits digests of a step differ (the sampled tokens may still agree).
    Digest { reference: String, served: String },
    /// The sampled tokens differ.
    Token { reference: u32, served: u32 },
    /// One side generated more tokens than the other.
    Length { reference: usize, served: usize },
}

/// The judgement of one session.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "verdict")]
pub enum Verdict {
    /// Every compared turn is bit-identical and every turn ran.
    Clean,
    /// First divergence at (turn, step).
    Corrupted {
        turn: usize,
        step: usize,
        divergence: Divergence,
    },
    /// The served side stopped at `turn` without diverging before it.
    Failed { turn: usize, failure: TurnFailure },
    /// The reference itself has no trace for a turn (a broken reference run).
    ReferenceFailed { turn: usize },
}

/// Compares one session.
pub fn compare(reference: &SessionTrace, served: &SessionTrace) -> Verdict {
    for (t, s) in served.turns.iter().enumerate() {
        let Some(r) = reference.turns.get(t) else {
            return Verdict::ReferenceFailed { turn: t };
        };
        for (step, ((rd, sd), (rt, st))) in r
            .digests
            .iter()
            .zip(&s.digests)
            .zip(r.tokens.iter().zip(&s.tokens))
            .enumerate()
        {
            if rd != sd {
                return Verdict::Corrupted {
                    turn: t,
                    step,
                    divergence: Divergence::Digest {
                        reference: format!("{rd:016x}"),
                        served: format!("{sd:016x}"),
                    },
                };
            }
            if rt != st {
                return Verdict::Corrupted {
                    turn: t,
                    step,
                    divergence: Divergence::Token {
                        reference: *rt,
                        served: *st,
                    },
                };
            }
        }
        if r.tokens.len() != s.tokens.len() || s.digests.len() != s.tokens.len() {
            return Verdict::Corrupted {
                turn: t,
                step: r.tokens.len().min(s.tokens.len()),
                divergence: Divergence::Length {
                    reference: r.tokens.len(),
                    served: s.tokens.len(),
                },
            };
        }
    }
    if let Some((turn, f)) = &served.failure {
        return Verdict::Failed {
            turn: *turn,
            failure: f.clone(),
        };
    }
    if reference.turns.len() > served.turns.len() {
        return Verdict::Failed {
            turn: served.turns.len(),
            failure: TurnFailure::Aborted,
        };
    }
    if reference.failure.is_some() {
        return Verdict::ReferenceFailed {
            turn: reference.turns.len(),
        };
    }
    Verdict::Clean
}

/// Counts over sessions.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Tally {
    pub sessions: usize,
    pub clean: usize,
    pub corrupted: usize,
    /// Sessions stopped by a refused (detected) request.
    pub refused: usize,
    /// Sessions stopped by a request past its deadline.
    pub wedged: usize,
    pub aborted: usize,
    pub reference_failed: usize,
    /// `(session, turn, step)` of each corrupted session's first divergence.
    pub first_divergences: Vec<(usize, usize, usize)>,
}

impl Tally {
    /// Judges every session (`served[i]` against the reference of the same session).
    pub fn of(reference: &[SessionTrace], served: &[SessionTrace]) -> (Tally, Vec<Verdict>) {
        let mut t = Tally::default();
        let mut verdicts = Vec::with_capacity(served.len());
        for s in served {
            t.sessions += 1;
            let v = match reference.iter().find(|r| r.session == s.session) {
                Some(r) => compare(r, s),
                None => Verdict::ReferenceFailed { turn: 0 },
            };
            match &v {
                Verdict::Clean => t.clean += 1,
                Verdict::Corrupted { turn, step, .. } => {
                    t.corrupted += 1;
                    t.first_divergences.push((s.session, *turn, *step));
                }
                Verdict::Failed { failure, .. } => match failure {
                    TurnFailure::Refused(_) => t.refused += 1,
                    TurnFailure::Wedged(_) => t.wedged += 1,
                    TurnFailure::Aborted => t.aborted += 1,
                },
                Verdict::ReferenceFailed { .. } => t.reference_failed += 1,
            }
            verdicts.push(v);
        }
        (t, verdicts)
    }

    /// Counts the sessions without comparing them with a reference (`--no-reference`):
    /// refusals, wedges and aborts as [`Tally::of`]; every other session counts as clean,
    /// since nothing but the servers' own checks judges it.
    pub fn unjudged(served: &[SessionTrace]) -> Tally {
        let mut t = Tally::default();
        for s in served {
            t.sessions += 1;
            match &s.failure {
                Some((_, TurnFailure::Refused(_))) => t.refused += 1,
                Some((_, TurnFailure::Wedged(_))) => t.wedged += 1,
                Some((_, TurnFailure::Aborted)) => t.aborted += 1,
                None => t.clean += 1,
            }
        }
        t
    }

    /// Corrupted sessions in percent of the sessions that were judged.
    pub fn corrupted_pct(&self) -> f64 {
        if self.sessions == 0 {
            0.0
        } else {
            100.0 * self.corrupted as f64 / self.sessions as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::run::TurnTrace;

    fn trace(turns: &[(&[u32], &[u64])]) -> SessionTrace {
        SessionTrace {
            session: 0,
            turns: turns
                .iter()
                .map(|(t, d)| TurnTrace {
                    prompt_tokens: 1,
                    tokens: t.to_vec(),
                    digests: d.to_vec(),
                    ttft: None,
                })
                .collect(),
            failure: None,
        }
    }

    #[test]
    fn first_divergence_is_named() {
        let r = trace(&[(&[1, 2, 3], &[10, 20, 30]), (&[4, 5], &[40, 50])]);
        assert_eq!(compare(&r, &r.clone()), Verdict::Clean);
        let s = trace(&[(&[1, 2, 3], &[10, 20, 30]), (&[4, 5], &[40, 51])]);
        assert!(matches!(
            compare(&r, &s),
            Verdict::Corrupted {
                turn: 1,
                step: 1,
                divergence: Divergence::Digest { .. }
            }
        ));
        let s = trace(&[(&[1, 9, 3], &[10, 20, 30]), (&[4, 5], &[40, 50])]);
        assert!(matches!(
            compare(&r, &s),
            Verdict::Corrupted {
                turn: 0,
                step: 1,
                divergence: Divergence::Token {
                    reference: 2,
                    served: 9
                }
            }
        ));
        let s = trace(&[(&[1, 2], &[10, 20]), (&[4, 5], &[40, 50])]);
        assert!(matches!(
            compare(&r, &s),
            Verdict::Corrupted {
                turn: 0,
                step: 2,
                ..
            }
        ));
        // A refused second turn after a clean first one is not corruption.
        let mut s = trace(&[(&[1, 2, 3], &[10, 20, 30])]);
        s.failure = Some((1, TurnFailure::Refused("checksum".into())));
        assert!(matches!(compare(&r, &s), Verdict::Failed { turn: 1, .. }));
        let (t, _) = Tally::of(std::slice::from_ref(&r), &[s]);
        assert_eq!((t.refused, t.corrupted, t.clean), (1, 0, 0));
        let (t, _) = Tally::of(std::slice::from_ref(&r), std::slice::from_ref(&r));
        assert_eq!((t.clean, t.corrupted_pct()), (1, 0.0));
    }
}
