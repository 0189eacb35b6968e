//! The decode worker's local prefill on the real model: prompts fed in
//! budgeted slices inside decode steps (mixed steps) give the same greedy
//! tokens as prefill then decode; a finished sequence's positions, answer
//! included, are reused by the next turn of its chat.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use common::{golden, greedy, ids, load, prompt_logits, second_turn, FIRST_QUESTION};
use pdmesh_engine::{ChatMessage, Engine, EngineOptions, SeqId};

/// The decode loop's way: every step gives each running sequence one token
/// and the oldest local prefills up to `budget` prompt tokens. Prompts are
/// admitted one per step, so prefills and decodes share steps.
fn mixed(e: &mut Engine, prompts: &[Vec<u32>], n: usize, budget: usize) -> Vec<Vec<u32>> {
    let mut out = vec![Vec::new(); prompts.len()];
    let mut waiting: Vec<usize> = (0..prompts.len()).rev().collect();
    let mut prefilling: Vec<(SeqId, usize)> = Vec::new();
    let mut running: Vec<(SeqId, usize)> = Vec::new();
    while !waiting.is_empty() || !prefilling.is_empty() || !running.is_empty() {
        if let Some(i) = waiting.pop() {
            prefilling.push((e.add_sequence(prompts[i].clone(), greedy(n)).unwrap(), i));
        }
        let mut runs: Vec<(SeqId, usize)> = running.iter().map(|(id, _)| (*id, 1)).collect();
        let mut left = budget;
        for (id, _) in &prefilling {
            let k = e.pending(*id).unwrap().min(left);
            if k == 0 {
                break;
            }
            runs.push((*id, k));
            left -= k;
        }
        for (id, logits) in e.forward_some(&runs, Default::default()).unwrap() {
            let ev = e.accept(id, &logits).unwrap();
            if let Some(p) = prefilling.iter().position(|(s, _)| *s == id) {
                running.push(prefilling.remove(p));
            }
            if ev.finish.is_some() {
                let p = running.iter().position(|(s, _)| *s == id).unwrap();
                let (id, i) = running.remove(p);
                out[i] = e.generated(id).unwrap().to_vec();
                e.release(id).unwrap();
            }
        }
    }
    out
}

#[test]
fn local_prefill_in_mixed_steps_gives_the_tokens_of_prefill_then_decode() {
    let mut cold = load(EngineOptions::default());
    let mut local = load(EngineOptions { prefix_cache_blocks: 256, cache_generated: true, ..Default::default() });
    let prompts: Vec<Vec<u32>> = golden().iter().map(|g| ids(&g["chat_ids"])).collect();
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| cold.engine.generate_all(std::slice::from_ref(p), &greedy(16), 1).unwrap().remove(0))
        .collect();
    // A budget of 7 spreads each prompt over several steps beside running decodes.
    for budget in [7, 256] {
        let got = mixed(&mut local.engine, &prompts, 16, budget);
        assert_eq!(got, want, "budget {budget}");
    }
    assert_eq!(local.engine.kv.used(), 0, "no block stays held");
    assert_eq!(local.engine.kv.free_blocks(), local.engine.kv.total());
}

/// Turn one of a chat as the decode worker runs it (prefilled, 24 decode
/// steps, released into the cache), and turn two's prompt.
fn two_turns(w: &mut common::Fixture) -> (Vec<u32>, Vec<u32>) {
    let turn1 = w.tok.encode_chat(&[ChatMessage::user(FIRST_QUESTION)]).unwrap();
    let a1 = mixed(&mut w.engine, std::slice::from_ref(&turn1), 24, 256).remove(0);
    let turn2 = second_turn(&w.tok, &a1);
    (turn1, turn2)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn without_answers_the_decode_cache_keeps_prompts_and_stays_exact() {
    let mut cold = load(EngineOptions::default());
    let mut w = load(EngineOptions { prefix_cache_blocks: 256, cache_generated: false, ..Default::default() });
    let (turn1, turn2) = two_turns(&mut w);
    let (want, _) = prompt_logits(&mut cold.engine, &turn2);
    let (got, reused) = prompt_logits(&mut w.engine, &turn2);
    assert!(
        reused > 0 && reused <= turn1.len(),
        "turn one's prompt (not its answer) is reused: {reused} of {}",
        turn1.len()
    );
    assert!(bits(&got) == bits(&want), "reusing prompt KV only keeps the logits bit for bit");
    assert_eq!(w.engine.kv.used(), 0);
}

#[test]
fn with_answers_the_next_turn_reuses_them_and_stays_close_to_cold() {
    let mut cold = load(EngineOptions::default());
    let mut w = load(EngineOptions { prefix_cache_blocks: 256, cache_generated: true, ..Default::default() });
    let (turn1, turn2) = two_turns(&mut w);
    let (want, _) = prompt_logits(&mut cold.engine, &turn2);
    let (got, reused) = prompt_logits(&mut w.engine, &turn2);
    assert!(
        reused > turn1.len() + 8,
        "the answer's positions are reused: {reused} of {} (turn one {})",
        turn2.len(),
        turn1.len()
    );
    // The answer's KV came from single-token decode kernels, not the
    // prefill's: close to a cold prefill's logits, not the same bits
    // (measured: at most ~2% of the largest logit on this chat).
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    let diff = want.iter().zip(&got).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(diff <= 0.05 * scale, "max |logit difference| {diff} against a largest logit of {scale}");
    let argmax = |v: &[f32]| (0..v.len()).max_by(|a, b| v[*a].total_cmp(&v[*b])).unwrap();
    assert_eq!(argmax(&got), argmax(&want));
    // This chat has no near-tie: its answer is the same token for token.
    let cold_out = cold.engine.generate_all(std::slice::from_ref(&turn2), &greedy(16), 1).unwrap();
    let warm_out = mixed(&mut w.engine, std::slice::from_ref(&turn2), 16, 256);
    assert_eq!(warm_out, cold_out);
    assert_eq!(w.engine.kv.used(), 0);
}
