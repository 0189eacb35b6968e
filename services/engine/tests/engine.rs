//! Step-API behaviour on the real model: batching, chunked prefill and KV
//! movement never change a sequence's tokens; bad input is a clear error.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use common::{fixture, golden, greedy, ids, load};
use pdmesh_engine::gguf::Gguf;
use pdmesh_engine::{EngineError, EngineOptions, Model, SamplingParams};

/// Prompts of different lengths: the golden chat prompts plus two long ones
/// (so chunking by 64 really splits them).
fn prompts(tok: &pdmesh_engine::Tokenizer) -> Vec<Vec<u32>> {
    let mut p: Vec<Vec<u32>> = golden().iter().map(|g| ids(&g["chat_ids"])).collect();
    p.push(pdmesh_engine::bench::prompt_tokens(tok, 150).unwrap());
    let mut long = tok.encode("Write a long story about a lighthouse keeper and a storm. ", false).unwrap();
    long.extend(pdmesh_engine::bench::prompt_tokens(tok, 97).unwrap());
    p.push(long);
    p
}

/// Decode a sequence until it finishes; its tokens, starting with `first`.
fn decode_to_end(engine: &mut pdmesh_engine::Engine, sid: pdmesh_engine::SeqId, first: u32) -> Vec<u32> {
    let mut got = vec![first];
    loop {
        let ev = engine.decode(&[sid]).unwrap().remove(0);
        got.push(ev.token);
        if ev.finish.is_some() {
            return got;
        }
    }
}

fn run_alone(f: &mut common::Fixture, p: &[u32], n: usize) -> Vec<u32> {
    f.engine.generate_all(&[p.to_vec()], &greedy(n), 1).unwrap().remove(0)
}

#[test]
fn batched_and_chunked_equal_alone() {
    let mut f = fixture();
    let ps = prompts(&f.tok);
    assert_eq!(ps.len(), 8);
    let alone: Vec<Vec<u32>> = ps.iter().map(|p| run_alone(&mut f, p, 12)).collect();
    let batched = f.engine.generate_all(&ps, &greedy(12), 8).unwrap();
    assert_eq!(batched, alone, "a batch of 8 changed some sequence's tokens");
    // Staggered admission (batch of 3 with joins as others finish).
    let staggered = f.engine.generate_all(&ps, &greedy(12), 3).unwrap();
    assert_eq!(staggered, alone);
    assert_eq!(f.engine.kv.used(), 0, "finished sequences must free their blocks");
    drop(f);

    let mut chunked = load(EngineOptions { prefill_chunk: 64, ..Default::default() });
    assert!(ps.iter().any(|p| p.len() > 128));
    let out = chunked.engine.generate_all(&ps, &greedy(12), 8).unwrap();
    assert_eq!(out, alone, "prefill in chunks of 64 changed the tokens");
}

#[test]
fn kv_export_import_into_another_engine_continues_identically() {
    let mut f = fixture();
    let prompt = ids(&golden()[2]["chat_ids"]);
    let reference = run_alone(&mut f, &prompt, 16);

    // Prefill here, move the KV bytes to a fresh engine, decode there.
    let id = f.engine.add_sequence(prompt.clone(), greedy(16)).unwrap();
    let first = f.engine.prefill(&[id]).unwrap().remove(0);
    let blob = f.engine.export_kv(id).unwrap();
    assert_eq!(blob.n_tokens, prompt.len());
    f.engine.release(id).unwrap();
    drop(f);

    let mut other = load(EngineOptions { kv_blocks: 64, ..Default::default() });
    // Occupy some blocks first so the sequence lands on different block ids.
    let _filler = other.engine.add_sequence(vec![1, 2, 3], greedy(40)).unwrap();
    let mut tokens = prompt.clone();
    tokens.push(first.token);
    let sid = other.engine.import_sequence(prompt.len(), tokens, greedy(16), &blob).unwrap();
    assert_eq!(decode_to_end(&mut other.engine, sid, first.token), reference);

    // The decode service's order: reserve first, then the bytes, then the
    // first token.
    let sid = other.engine.add_sequence(prompt.clone(), greedy(16)).unwrap();
    let short = pdmesh_engine::KvBlob { n_tokens: prompt.len() - 1, ..blob.clone() };
    assert!(matches!(other.engine.import_prompt_kv(sid, &short), Err(EngineError::KvMismatch(_))));
    other.engine.import_prompt_kv(sid, &blob).unwrap();
    let ev = other.engine.attach_first_token(sid, first.token).unwrap();
    assert!(ev.finish.is_none());
    assert!(other.engine.attach_first_token(sid, first.token).is_err(), "a second first token is refused");
    assert_eq!(decode_to_end(&mut other.engine, sid, first.token), reference);
}

/// Seeded sampling (temperature 0.9, top-k 40, seed 11) for `max_tokens`, EOS ignored.
fn seeded(max_tokens: usize) -> SamplingParams {
    SamplingParams { temperature: 0.9, top_k: 40, seed: 11, max_tokens, ignore_eos: true, ..Default::default() }
}

#[test]
fn a_replayed_sequence_goes_on_exactly_as_the_one_it_continues() {
    // A migrated request: the first 10 tokens are replayed (their KV
    // computed as the lost worker's decode steps did, all ten rows in one
    // step), then sampling goes on.
    let mut f = fixture();
    let prompt = ids(&golden()[1]["chat_ids"]);
    let seeded = seeded(32);
    for params in [greedy(32), seeded] {
        let whole = f.engine.generate_all(std::slice::from_ref(&prompt), &params, 1).unwrap().remove(0);
        let replay = SamplingParams { replay: whole[..10].to_vec(), ..params.clone() };
        let id = f.engine.add_sequence(prompt.clone(), replay).unwrap();
        let mut evs = vec![f.engine.prefill(&[id]).unwrap().remove(0)];
        while evs.last().unwrap().finish.is_none() {
            evs.push(f.engine.decode(&[id]).unwrap().remove(0));
        }
        let tokens = f.engine.generated(id).unwrap().to_vec();
        f.engine.release(id).unwrap();
        assert_eq!(tokens, whole, "{params:?}");
        // The prompt's step (it yields the first replayed token), one step
        // for the other nine, then a step per new token.
        assert_eq!(evs.len(), 1 + 32 - 10, "{params:?}");
        let replayed: Vec<bool> = evs.iter().map(|e| e.replayed).collect();
        assert!(replayed[0] && replayed[1..].iter().all(|r| !*r), "{replayed:?}");
    }
    let too_many = SamplingParams { replay: vec![1; 4], ..greedy(4) };
    assert!(matches!(f.engine.add_sequence(prompt.clone(), too_many), Err(EngineError::InvalidArgument(_))));
    let bad = SamplingParams { replay: vec![u32::MAX], ..greedy(4) };
    assert!(matches!(f.engine.add_sequence(prompt, bad), Err(EngineError::BadToken(_))));
}

#[test]
fn a_sequence_handed_over_with_its_kv_goes_on_exactly_as_it_would_have() {
    // A draining worker's sequence after 10 tokens: its KV (prompt and the
    // first 9 generated) moves to another engine, which goes on from the
    // 10th with no step replaying them; greedy and seeded alike.
    let mut f = fixture();
    let prompt = ids(&golden()[1]["chat_ids"]);
    let seeded = seeded(32);
    let mut other = load(EngineOptions { kv_blocks: 64, ..Default::default() });
    for params in [SamplingParams { ignore_eos: true, ..greedy(32) }, seeded] {
        let whole = f.engine.generate_all(std::slice::from_ref(&prompt), &params, 1).unwrap().remove(0);
        let id = f.engine.add_sequence(prompt.clone(), params.clone()).unwrap();
        let mut sent = vec![f.engine.prefill(&[id]).unwrap().remove(0).token];
        while sent.len() < 10 {
            sent.push(f.engine.decode(&[id]).unwrap().remove(0).token);
        }
        let blob = f.engine.export_kv(id).unwrap();
        assert_eq!(blob.n_tokens, prompt.len() + 9);
        f.engine.release(id).unwrap();

        let continued = SamplingParams { replay: sent.clone(), ..params.clone() };
        let sid = other.engine.reserve_continued(prompt.clone(), continued).unwrap();
        let short = pdmesh_engine::KvBlob { n_tokens: prompt.len(), ..blob.clone() };
        assert!(matches!(other.engine.import_prompt_kv(sid, &short), Err(EngineError::KvMismatch(_))));
        other.engine.import_prompt_kv(sid, &blob).unwrap();
        assert_eq!(other.engine.transfer_checksums(sid).unwrap().len(), blob.n_tokens.div_ceil(16));
        let ev = other.engine.attach_first_token(sid, sent[9]).unwrap();
        assert!(ev.replayed && ev.token == sent[9], "{ev:?}");
        let mut tokens = sent.clone();
        let mut last = ev;
        while last.finish.is_none() {
            last = other.engine.decode(&[sid]).unwrap().remove(0);
            assert!(!last.replayed);
            tokens.push(last.token);
        }
        other.engine.release(sid).unwrap();
        assert_eq!(tokens, whole, "{params:?}");
    }
    assert!(matches!(other.engine.reserve_continued(prompt, greedy(4)), Err(EngineError::InvalidArgument(_))));
    assert_eq!(other.engine.kv.used(), 0);
}

#[test]
fn admission_and_input_errors_are_clear_and_take_nothing() {
    let mut f = fixture();
    let before = f.engine.kv.used();
    assert!(matches!(f.engine.add_sequence(vec![], greedy(4)), Err(EngineError::EmptyPrompt)));
    assert!(matches!(f.engine.add_sequence(vec![1, 2], greedy(0)), Err(EngineError::InvalidArgument(_))));
    assert!(matches!(f.engine.add_sequence(vec![1, 999_999], greedy(4)), Err(EngineError::BadToken(999_999))));
    let ctx = f.engine.model.config.context_length;
    let e = f.engine.add_sequence(vec![1; ctx], greedy(4)).unwrap_err();
    assert!(matches!(e, EngineError::PromptTooLong { .. }), "{e}");
    assert!(e.to_string().contains("context holds 8192"), "{e}");
    let hot = SamplingParams { temperature: 5.0, ..greedy(4) };
    assert!(f.engine.add_sequence(vec![1, 2], hot).is_err());
    assert_eq!(f.engine.kv.used(), before, "rejected requests must not hold blocks");
    assert!(matches!(f.engine.release(123_456), Err(EngineError::UnknownSequence(_))));
}

#[test]
fn full_kv_cache_rejects_then_recovers() {
    let mut small = load(EngineOptions { kv_blocks: 8, ..Default::default() });
    let e = &mut small.engine;
    let a = e.add_sequence(vec![1; 100], greedy(20)).unwrap(); // 119 positions: 8 blocks
    let err = e.add_sequence(vec![1; 5], greedy(4)).unwrap_err();
    assert!(matches!(err, EngineError::KvFull { needed: 1, free: 0, total: 8 }), "{err}");
    e.release(a).unwrap();
    assert!(e.add_sequence(vec![1; 5], greedy(4)).is_ok());
}

#[test]
fn bad_model_files_are_clear_errors() {
    let dir = std::env::temp_dir().join(format!("pdmesh-badmodel-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let missing = dir.join("nope.gguf");
    let e = Gguf::open(&missing).unwrap_err().to_string();
    assert!(e.contains("cannot read model file") && e.contains("nope.gguf"), "{e}");

    let not_gguf = dir.join("text.gguf");
    std::fs::write(&not_gguf, b"hello, I am not a model").unwrap();
    let e = Gguf::open(&not_gguf).unwrap_err().to_string();
    assert!(e.contains("wrong magic"), "{e}");

    let real = std::fs::read(common::model_path()).unwrap();
    for cut in [6usize, 1000, 2_000_000, real.len() - 10] {
        let p = dir.join(format!("cut{cut}.gguf"));
        std::fs::write(&p, &real[..cut]).unwrap();
        let e = match Gguf::open(&p) {
            Err(e) => e.to_string(),
            Ok(g) => Model::from_gguf(&g).map(|_| ()).unwrap_err().to_string(),
        };
        assert!(e.contains("truncated") || e.contains("file ends"), "cut at {cut}: {e}");
    }

    // An architecture the engine does not run, and a tensor of a type it
    // cannot read, are refused by name (the real file, one field changed).
    let find = |hay: &[u8], needle: &[u8]| hay.windows(needle.len()).position(|w| w == needle).unwrap();
    let mut other = real.clone();
    let at = find(&other, b"general.architecture") + b"general.architecture".len() + 4 + 8;
    assert_eq!(&other[at..at + 5], b"llama");
    other[at..at + 5].copy_from_slice(b"mamba");
    let p = dir.join("mamba.gguf");
    std::fs::write(&p, &other).unwrap();
    let e = Model::from_gguf(&Gguf::open(&p).unwrap()).unwrap_err().to_string();
    assert!(e.contains("\"mamba\"") && e.contains("llama, gemma3"), "{e}");

    let mut iq = real.clone();
    // output_norm.weight: name, 1 dimension (u32), 576 (u64), then its type id (u32, F32 = 0).
    let at = find(&iq, b"output_norm.weight") + b"output_norm.weight".len() + 4 + 8;
    assert_eq!(&iq[at..at + 4], &0u32.to_le_bytes());
    iq[at..at + 4].copy_from_slice(&16u32.to_le_bytes());
    let p = dir.join("iq2.gguf");
    std::fs::write(&p, &iq).unwrap();
    let e = Gguf::open(&p).unwrap_err().to_string();
    assert!(e.contains("output_norm.weight") && e.contains("IQ2_XXS"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn incremental_detokenizer_never_splits_a_character() {
    let f = fixture();
    let text = "naïve café — 日本語 🚀🧪 ok";
    let ids = f.tok.encode(text, false).unwrap();
    let mut d = pdmesh_engine::IncrementalDecoder::new(false);
    let mut out = String::new();
    for id in &ids {
        let piece = d.push(&f.tok, *id);
        assert!(!piece.contains('\u{FFFD}'), "emitted a broken character after token {id}");
        out.push_str(&piece);
    }
    out.push_str(&d.finish());
    assert_eq!(out, text);
    // Some token of the emoji is a partial UTF-8 sequence, so the test is meaningful.
    assert!(ids.iter().any(|i| std::str::from_utf8(f.tok.token_bytes(*i).unwrap()).is_err()));
}
