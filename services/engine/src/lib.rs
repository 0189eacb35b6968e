//! pdmesh model runtime.
//!
//! Loads a llama-architecture GGUF (here SmolLM2-135M-Instruct, Q4_1) and
//! runs it on CPU through `pdmesh-kernels`:
//!
//! - [`gguf`]: the file reader; [`config`]: hyper-parameters from metadata;
//! - [`tokenizer`]: byte-level BPE, chat template, incremental detokenizer;
//! - [`model`]: the batched llama forward pass;
//! - [`kv`]: the paged KV cache, whose blocks export and import as bytes;
//!   [`blocks`]: which blocks are free, held, or cached for prefix reuse;
//! - [`engine`]: sequences, batched `prefill`/`decode` steps, sampling
//!   ([`sampler`]), and a continuous-batching `generate_all`;
//!
//! ```no_run
//! use pdmesh_engine::{Engine, EngineOptions, Model, SamplingParams, Tokenizer};
//! let (model, gguf) = Model::load(&pdmesh_model::CacheArgs::from_env().ensure_model()?)?;
//! let tok = Tokenizer::from_gguf(&gguf)?;
//! let mut engine = Engine::new(model, EngineOptions::default())?;
//! let ids = tok.encode_chat(&[pdmesh_engine::ChatMessage::user("Hi")])?;
//! let out = engine.generate_all(&[ids], &SamplingParams::greedy(16), 1)?;
//! println!("{}", tok.decode(&out[0], false));
//! # Ok::<(), pdmesh_engine::EngineError>(())
//! ```

pub mod bench;
pub mod blocks;
pub mod config;
pub mod engine;
pub mod error;
pub mod gguf;
pub mod kv;
pub mod model;
pub mod sampler;
pub mod tokenizer;

pub use config::ModelConfig;
pub use engine::{ComputeBackend, Engine, EngineOptions, FinishReason, SeqId, Sizing, TokenEvent, TransferArena};
pub use error::EngineError;
pub use kv::{KvBlob, KvCache, KvLayout};
pub use model::Model;
pub use pdmesh_kernels::pool::{os_thread_id, PoolShare};
pub use sampler::{NextToken, SamplingParams};
pub use tokenizer::{ChatMessage, IncrementalDecoder, Tokenizer};
