//! The decode worker's local prefill on the real model: prompts fed in
//! budgeted slices inside decode steps (mixed steps) give the same greedy
//! tokens as prefill then decode; a finished sequence's positions, answer
//! included, are reused by the next turn of its chat.

mod common;

use common::{golden, ids, load};
use pdmesh_engine::{Engine, EngineOptions, SamplingParams, SeqId};

fn greedy(n: usize) -> SamplingParams {
    SamplingParams { max_tokens: n, ignore_eos: true, ..Default::default() }
}

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
