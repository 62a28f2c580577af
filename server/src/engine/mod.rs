//! The engine: a synthetic DSA decoder (config, seeded weights, byte-level tokenizer,
//! forward pass), its KV space, sampling, and the continuous-batching scheduler.

pub mod batch;
pub mod cache_space;
pub mod config;
pub mod info;
pub mod json_object;
pub mod kernel_check;
pub mod kv;
pub mod model;
pub mod options;
pub mod request;
pub mod sampling;
pub mod scheduler;
pub mod service;
pub mod tokenizer;
pub mod weights;

pub use batch::{SeqChunk, StepBatch};
pub use cache_space::{CacheHandle, CacheKvSpace, CacheSpaceOptions};
pub use config::ModelConfig;
pub use info::{CacheInfo, EngineInfo, EngineStats, PdInfo};
pub use kv::{KvSpace, KvStep, LayerCache, PagedKvSpace, PromptSource, ReceivedPages, SeqId};
pub use model::{logits_digest, Model, StepLogits};
pub use options::{CacheOptions, EngineOptions, ReplyScript, StepFault};
pub use request::{
    Completion, Event, FinishReason, Finished, GenerateRequest, RequestHandle, TokenEvent,
};
pub use sampling::SamplingParams;
pub use scheduler::{BLOCKED_WAIT, IDLE_WAIT};
pub use service::{random_id, Engine};
