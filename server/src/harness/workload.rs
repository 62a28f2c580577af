//! The agentic workload of SERVING.md: many concurrent multi-turn sessions of a coding
//! agent. Every session starts from one shared system prompt (agent instructions plus a
//! JSON tool schema, ~1.5 KB), branches from one of a few shared project contexts (so
//! prefixes are shared across sessions at two depths), and then alternates user messages
//! and tool results (JSON-ish, 200–800 bytes each) with the model's replies (16–32
//! tokens). Each turn starts after a small random jitter.
//!
//! A workload is a pure function of its [`WorkloadConfig`] (seed included); the replies
//! are the model's and are appended when the session runs
//! ([`SessionPlan::prompt`]).

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::engine::sampling::SamplingParams;
use crate::engine::tokenizer::{ChatMessage, Role, ASSISTANT, BOS, END};

/// Shape of a workload.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorkloadConfig {
    pub sessions: usize,
    pub turns: usize,
    /// Shared project contexts sessions branch from.
    pub contexts: usize,
    /// Largest delay before a turn starts, in milliseconds.
    pub max_jitter_ms: u64,
    pub seed: u64,
}

impl Default for WorkloadConfig {
    fn default() -> Self {
        WorkloadConfig {
            sessions: 80,
            turns: 4,
            contexts: 4,
            max_jitter_ms: 50,
            seed: 0,
        }
    }
}

/// What a turn sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnKind {
    /// A user message.
    User,
    /// A tool result (the reply before it was a tool call).
    ToolResult,
}

/// One turn of a session, before the model has answered.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TurnPlan {
    pub kind: TurnKind,
    /// The message text (200–800 bytes).
    pub message: String,
    /// Sampling for the reply: 16–32 tokens, greedy or seeded temperature sampling.
    pub sampling: SamplingParams,
    /// Delay before the turn is sent, in milliseconds.
    pub jitter_ms: u64,
}

/// One session: its project context and turns.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SessionPlan {
    pub id: usize,
    /// Index into [`Workload::contexts`].
    pub context: usize,
    pub turns: Vec<TurnPlan>,
}

/// A generated workload.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Workload {
    pub config: WorkloadConfig,
    /// Agent instructions and tool schema (the first, shared, message).
    pub system: String,
    /// Shared project contexts.
    pub contexts: Vec<String>,
    pub sessions: Vec<SessionPlan>,
}

const TOOLS: &str = r#"[{"type":"function","function":{"name":"read_file","description":"Read a file of the repository","parameters":{"type":"object","properties":{"path":{"type":"string"},"start_line":{"type":"integer"},"end_line":{"type":"integer"}},"required":["path"]}}},{"type":"function","function":{"name":"grep","description":"Search the repository for a regular expression","parameters":{"type":"object","properties":{"pattern":{"type":"string"},"glob":{"type":"string"}},"required":["pattern"]}}},{"type":"function","function":{"name":"run","description":"Run a shell command in the sandbox and return its output","parameters":{"type":"object","properties":{"command":{"type":"string"},"timeout_s":{"type":"integer"}},"required":["command"]}}},{"type":"function","function":{"name":"apply_patch","description":"Apply a unified diff to the working tree","parameters":{"type":"object","properties":{"diff":{"type":"string"}},"required":["diff"]}}}]"#;

const WORDS: &[&str] = &[
    "cache",
    "page",
    "layer",
    "index",
    "kernel",
    "token",
    "request",
    "decode",
    "prefill",
    "buffer",
    "fence",
    "ready",
    "transfer",
    "offset",
    "stride",
    "layout",
    "checksum",
    "scheduler",
    "batch",
    "stream",
    "error",
    "retry",
    "config",
    "module",
    "function",
    "test",
    "build",
    "commit",
    "branch",
    "review",
    "latency",
    "throughput",
    "session",
    "the",
    "a",
    "of",
    "to",
    "in",
    "and",
    "with",
    "for",
    "when",
    "after",
    "before",
    "is",
];

const FILES: &[&str] = &[
    "src/cache/pool.rs",
    "src/engine/model.rs",
    "src/http/mod.rs",
    "kernels/topk.rs",
    "tests/integration.rs",
    "docs/design.md",
    "src/transfer/frame.rs",
    "Cargo.toml",
];

const TOOL_NAMES: &[&str] = &["read_file", "grep", "run", "apply_patch"];

fn words(rng: &mut ChaCha8Rng, n: usize) -> String {
    (0..n)
        .map(|_| *WORDS.choose(rng).unwrap_or(&"x"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Text of about `target` bytes built by `piece` until long enough, cut at `target`.
fn sized(
    rng: &mut ChaCha8Rng,
    target: usize,
    mut piece: impl FnMut(&mut ChaCha8Rng) -> String,
) -> String {
    let mut s = String::new();
    while s.len() < target {
        s.push_str(&piece(rng));
    }
    s.truncate(target);
    s
}

fn user_message(rng: &mut ChaCha8Rng, len: usize) -> String {
    let file = *FILES.choose(rng).unwrap_or(&"x");
    let head = format!("{{\"task\": \"In {file}, {} ", words(rng, 6));
    let mut body = sized(rng, len.saturating_sub(head.len() + 3), |r| {
        format!("{}. ", words(r, 9))
    });
    body = body.replace('"', "'");
    format!("{head}{body}\"}}")
}

fn tool_result(rng: &mut ChaCha8Rng, len: usize, call: usize) -> String {
    let name = *TOOL_NAMES.choose(rng).unwrap_or(&"run");
    let head =
        format!("{{\"tool_call_id\": \"call_{call}\", \"name\": \"{name}\", \"content\": \"");
    let body = sized(rng, len.saturating_sub(head.len() + 3), |r| {
        let line: u32 = r.gen_range(1..900);
        format!("{line}: {}\\n", words(r, 7))
    });
    format!("{head}{body}\"}}")
}

impl Workload {
    /// Generates the workload of `config`.
    pub fn generate(config: &WorkloadConfig) -> Workload {
        let mut rng = ChaCha8Rng::seed_from_u64(config.seed ^ 0x5eed_a6e7);
        let system = format!(
            "You are a coding agent working in a large Rust repository. Work in small, \
             verified steps: read before you edit, run the tests after every change, and \
             explain what you did in one short paragraph. Call tools by replying with a \
             JSON object {{\"name\": ..., \"arguments\": {{...}}}}. Never invent file \
             contents; read them. Never run destructive commands.\n# Tools\n{TOOLS}"
        );
        let contexts = (0..config.contexts.max(1))
            .map(|c| {
                let len = rng.gen_range(600..1000);
                let head = format!("# Project {c}\nRepository layout and conventions:\n");
                let body = sized(&mut rng, len, |r| {
                    let f = *FILES.choose(r).unwrap_or(&"x");
                    format!("- {f}: {}\n", words(r, 8))
                });
                format!("{head}{body}")
            })
            .collect::<Vec<_>>();
        let mut calls = 0;
        let sessions = (0..config.sessions)
            .map(|id| {
                let context = rng.gen_range(0..contexts.len());
                let turns = (0..config.turns)
                    .map(|t| {
                        let len = rng.gen_range(200..=800);
                        let kind = if t > 0 && rng.gen_bool(0.5) {
                            TurnKind::ToolResult
                        } else {
                            TurnKind::User
                        };
                        let message = match kind {
                            TurnKind::User => user_message(&mut rng, len),
                            TurnKind::ToolResult => {
                                calls += 1;
                                tool_result(&mut rng, len, calls)
                            }
                        };
                        let sampled = rng.gen_bool(0.5);
                        TurnPlan {
                            kind,
                            message,
                            sampling: SamplingParams {
                                max_new_tokens: rng.gen_range(16..=32),
                                temperature: if sampled { 0.8 } else { 0.0 },
                                seed: rng.gen(),
                                ignore_eos: true,
                                ..Default::default()
                            },
                            jitter_ms: rng.gen_range(0..=config.max_jitter_ms),
                        }
                    })
                    .collect();
                SessionPlan { id, context, turns }
            })
            .collect();
        Workload {
            config: config.clone(),
            system,
            contexts,
            sessions,
        }
    }
}

impl SessionPlan {
    /// The prompt of turn `turn` given the model's replies to the turns before it
    /// (`replies[i]` = generated token ids of turn `i`, a final end-of-turn excluded):
    /// `<|bos|>` system, the project context with the first message, then alternately
    /// assistant replies and the following messages, ending with `<|assistant|>`.
    pub fn prompt(&self, w: &Workload, turn: usize, replies: &[Vec<u32>]) -> Vec<u32> {
        let mut out = vec![BOS];
        crate::engine::tokenizer::push_message(
            &mut out,
            &ChatMessage::new(Role::System, w.system.clone()),
        );
        for (t, plan) in self.turns.iter().enumerate().take(turn + 1) {
            let (role, text) = match plan.kind {
                TurnKind::User if t == 0 => (
                    Role::User,
                    format!("{}\n\n{}", w.contexts[self.context], plan.message),
                ),
                TurnKind::User => (Role::User, plan.message.clone()),
                TurnKind::ToolResult => (Role::Tool, plan.message.clone()),
            };
            crate::engine::tokenizer::push_message(&mut out, &ChatMessage::new(role, text));
            if t < turn {
                out.push(ASSISTANT);
                let r = replies.get(t).map_or(&[][..], Vec::as_slice);
                out.extend(r.iter().copied().filter(|&x| x != END));
                out.push(END);
            }
        }
        out.push(ASSISTANT);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_and_shared_prefixes() {
        let cfg = WorkloadConfig {
            sessions: 12,
            turns: 4,
            ..Default::default()
        };
        let w = Workload::generate(&cfg);
        assert_eq!(w, Workload::generate(&cfg), "a pure function of the config");
        assert!(
            (1000..=2048).contains(&w.system.len()),
            "{}",
            w.system.len()
        );
        assert!(w.system.contains("\"name\":\"read_file\""));
        for s in &w.sessions {
            for t in &s.turns {
                assert!(
                    (200..=800).contains(&t.message.len()),
                    "{}",
                    t.message.len()
                );
                assert!(t.message.starts_with('{') && t.message.ends_with('}'));
                assert!((16..=32).contains(&t.sampling.max_new_tokens));
            }
            assert_eq!(s.turns[0].kind, TurnKind::User);
        }
        assert!(w
            .sessions
            .iter()
            .flat_map(|s| &s.turns)
            .any(|t| t.kind == TurnKind::ToolResult));
        // Two sessions on one context share the system prompt and the context.
        let (a, b) = w
            .sessions
            .iter()
            .flat_map(|a| w.sessions.iter().map(move |b| (a, b)))
            .find(|(a, b)| a.id < b.id && a.context == b.context)
            .unwrap_or_else(|| panic!("no two sessions share a context"));
        let (pa, pb) = (a.prompt(&w, 0, &[]), b.prompt(&w, 0, &[]));
        let shared = pa.iter().zip(&pb).take_while(|(x, y)| x == y).count();
        assert!(shared > w.system.len() + w.contexts[a.context].len());
        // Later turns extend earlier prompts with the reply.
        let reply = vec![65u32, 66, END];
        let p1 = a.prompt(&w, 1, &[reply]);
        assert_eq!(p1[..pa.len()], pa[..]);
        assert_eq!(p1[pa.len()..pa.len() + 3], [65, 66, END]);
    }
}
