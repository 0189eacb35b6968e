//! The prefix cache on the real model: a prompt whose head comes from the
//! cache gets the same logits, bit for bit, and the same greedy tokens as
//! one computed from scratch; blocks are never leaked.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use common::{golden, greedy, ids, load, prompt_logits, second_turn, Fixture, FIRST_QUESTION};
use pdmesh_engine::{ChatMessage, Engine, EngineOptions};

fn cold() -> Fixture {
    load(EngineOptions::default())
}

fn warm(extra: EngineOptions) -> Fixture {
    load(EngineOptions { prefix_cache_blocks: 512, ..extra })
}

/// The logits' bits (compared as one hash so a failure prints two numbers,
/// not 49,152) and the argmax.
fn bits(v: &[f32]) -> (u64, usize) {
    let words: Vec<u32> = v.iter().map(|x| x.to_bits()).collect();
    let argmax = (0..v.len()).max_by(|a, b| v[*a].total_cmp(&v[*b])).unwrap_or(0);
    (pdmesh_prefix::hash::block_hash(0, &words), argmax)
}

/// Every block is free or cached-unreferenced once nothing runs.
fn all_blocks_idle(e: &Engine) {
    assert_eq!(e.kv.used(), 0, "no block may stay held");
    assert_eq!(e.kv.free_blocks(), e.kv.total(), "free plus evictable covers the arena");
}

#[test]
fn golden_prompts_from_the_cache_match_cold_logits_bit_for_bit() {
    let mut c = cold();
    let mut w = warm(EngineOptions::default());
    let mut hits = 0;
    for g in golden() {
        let p = ids(&g["chat_ids"]);
        let (want, _) = prompt_logits(&mut c.engine, &p);
        let (first, r0) = prompt_logits(&mut w.engine, &p);
        let (again, r1) = prompt_logits(&mut w.engine, &p);
        assert_eq!(bits(&first), bits(&want), "cache on, first run of {:?}", g["prompt"]);
        assert_eq!(bits(&again), bits(&want), "cache hit ({r1} tokens) changed the logits of {:?}", g["prompt"]);
        assert!(r1 >= r0);
        assert_eq!(r1, p.len() - 1, "every position but the last is reused");
        hits += usize::from(r1 > 0);
        // And the generated tokens.
        let cold_out = c.engine.generate_all(std::slice::from_ref(&p), &greedy(12), 1).unwrap();
        let warm_out = w.engine.generate_all(std::slice::from_ref(&p), &greedy(12), 1).unwrap();
        assert_eq!(warm_out, cold_out);
    }
    assert!(hits >= 3, "the golden chat prompts are long enough to hit");
    assert!(w.engine.kv.blocks.counters().hit_tokens > 0);
    all_blocks_idle(&w.engine);
}

#[test]
fn a_one_token_tail_and_chunk_boundaries_keep_the_cold_summation_order() {
    let chunked = EngineOptions { prefill_chunk: 64, ..Default::default() };
    let mut c = load(chunked.clone());
    let mut w = warm(chunked);
    let long = pdmesh_engine::bench::prompt_tokens(&c.tok, 200).unwrap();
    // 65: the tail is one token inside a 65-token cold chunk (tinyBLAS order);
    // 129: the tail is the one-token last cold chunk (vec-dot order);
    // 150: the cached head ends inside the third cold chunk; 64: a whole block is recomputed.
    for len in [65usize, 129, 150, 64, 17] {
        let p = &long[..len];
        let (want, _) = prompt_logits(&mut c.engine, p);
        let _ = prompt_logits(&mut w.engine, p);
        let (got, reused) = prompt_logits(&mut w.engine, p);
        assert_eq!(reused, len - 1, "length {len}");
        assert_eq!(bits(&got), bits(&want), "length {len}, {reused} tokens reused");
    }
    // Prompts extending a cached one: position 64 of the 65-token prompt
    // ran as a one-token chunk (vec-dot order), so it is not reused by a
    // longer prompt, whose cold prefill runs it in a 80-token chunk.
    // (Tokens from 7 on: nothing of them is cached yet.)
    let other = &long[7..];
    let _ = prompt_logits(&mut w.engine, &other[..65]);
    for (len, want_reused) in [(80usize, 64usize), (140, 80)] {
        let (want, _) = prompt_logits(&mut c.engine, &other[..len]);
        let (got, reused) = prompt_logits(&mut w.engine, &other[..len]);
        assert_eq!(reused, want_reused, "length {len}");
        assert_eq!(bits(&got), bits(&want), "length {len}, {reused} tokens reused");
    }
    all_blocks_idle(&w.engine);
}

#[test]
fn a_multi_turn_chat_reuses_the_first_turn_and_answers_as_cold() {
    let mut c = cold();
    let mut w = warm(EngineOptions::default());
    let turn1 = w.tok.encode_chat(&[ChatMessage::user(FIRST_QUESTION)]).unwrap();
    let a1 = w.engine.generate_all(std::slice::from_ref(&turn1), &greedy(24), 1).unwrap().remove(0);
    let turn2 = second_turn(&w.tok, &a1);
    assert_eq!(turn2[..turn1.len() - 3], turn1[..turn1.len() - 3], "turn two extends turn one");
    let (want, _) = prompt_logits(&mut c.engine, &turn2);
    let (got, reused) = prompt_logits(&mut w.engine, &turn2);
    assert!(reused >= (turn1.len() - 3) / 16 * 16 && reused > 0, "reused {reused} of turn one's {}", turn1.len());
    assert_eq!(bits(&got), bits(&want));
    let cold_out = c.engine.generate_all(std::slice::from_ref(&turn2), &greedy(16), 1).unwrap();
    let warm_out = w.engine.generate_all(std::slice::from_ref(&turn2), &greedy(16), 1).unwrap();
    assert_eq!(warm_out, cold_out);
    all_blocks_idle(&w.engine);
}

#[test]
fn eviction_under_pressure_never_changes_tokens_or_leaks_blocks() {
    // 16 blocks: a batch of four ~40-token prompts with 8 new tokens each
    // holds 12 or more, and the eight families' heads alone are 16 blocks,
    // so cached prefixes are evicted all the time.
    let small = EngineOptions { kv_blocks: 16, ..Default::default() };
    let mut c = load(small.clone());
    let mut w = warm(small);
    let base = pdmesh_engine::bench::prompt_tokens(&c.tok, 120).unwrap();
    // Eight families of prompts (distinct heads), each seen several times
    // with different tails: hits within a family, evictions across them.
    let prompts: Vec<Vec<u32>> = (0..16)
        .map(|i| {
            let family = [0, 1, 0, 2, 1, 3, 0, 4, 5, 2, 6, 0, 7, 3, 1, 0][i];
            let mut p = base[family * 10..family * 10 + 34].to_vec();
            p.extend(base[90..90 + 2 + i % 7].iter());
            p
        })
        .collect();
    for round in prompts.chunks(4) {
        let want = c.engine.generate_all(round, &greedy(8), 4).unwrap();
        let got = w.engine.generate_all(round, &greedy(8), 4).unwrap();
        assert_eq!(got, want);
        all_blocks_idle(&w.engine);
    }
    let n = w.engine.kv.blocks.counters();
    assert!(n.hits > 0 && n.evictions > 0, "the test must exercise both hits and evictions: {n:?}");
}
