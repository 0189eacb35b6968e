//! The forward pass on a GPU (`--backend cuda`) against the CPU engine on
//! the golden prompts: greedy tokens equal, or, at the first difference,
//! the CPU's own top two logits within a near-tie (0.05 apart), where the
//! GPU's other summation order may fairly pick the other. Also the prompt
//! logits, a KV export taken from VRAM, and batched decoding. Without a GPU
//! each test prints why and is counted as skipped.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::{Arc, Mutex};

use common::{golden, greedy, ids, load, prompt_logits};
use pdmesh_engine::model::{kernel_attr, StepOptions};
use pdmesh_engine::{ComputeBackend, EngineOptions};

/// Logits closer than this at the top are a near-tie.
const NEAR_TIE: f32 = 0.05;

fn gpu_engine(test: &str) -> Option<common::Fixture> {
    if common::no_gpu(test) {
        return None;
    }
    Some(load(EngineOptions { backend: ComputeBackend::Cuda, ..Default::default() }))
}

/// The top two logits' gap.
fn top2_gap(l: &[f32]) -> f32 {
    let mut v = l.to_vec();
    v.sort_by(|a, b| b.total_cmp(a));
    v[0] - v[1]
}

#[test]
fn cuda_greedy_tokens_equal_the_cpus_but_at_near_ties() {
    let Some(mut gpu) = gpu_engine("cuda_greedy_tokens_equal_the_cpus_but_at_near_ties") else { return };
    let mut cpu = load(EngineOptions::default());
    assert!(gpu.engine.on_gpu(), "{}", gpu.engine.backend_note);
    let prompts: Vec<Vec<u32>> = golden().iter().map(|g| ids(&g["chat_ids"])).collect();
    let g_out = gpu.engine.generate_all(&prompts, &greedy(32), 8).unwrap();
    let c_out = cpu.engine.generate_all(&prompts, &greedy(32), 8).unwrap();
    for ((p, g), c) in prompts.iter().zip(&g_out).zip(&c_out) {
        if g == c {
            continue;
        }
        let at = g.iter().zip(c).position(|(a, b)| a != b).unwrap_or(g.len().min(c.len()));
        let mut prefix = p.clone();
        prefix.extend_from_slice(&c[..at]);
        let (logits, _) = prompt_logits(&mut cpu.engine, &prefix);
        let gap = top2_gap(&logits);
        assert!(
            gap < NEAR_TIE,
            "GPU and CPU differ at token {at} where the CPU's top two are {gap} apart (not a near-tie)"
        );
        eprintln!("near-tie at token {at} (top-2 gap {gap}): GPU {:?}, CPU {:?}", &g[at..], &c[at..]);
    }
}

#[test]
fn cuda_prompt_logits_and_kv_export_match_the_cpu() {
    let Some(mut gpu) = gpu_engine("cuda_prompt_logits_and_kv_export_match_the_cpu") else { return };
    let mut cpu = load(EngineOptions::default());
    let prompt = ids(&golden()[2]["chat_ids"]);
    let (lg, _) = prompt_logits(&mut gpu.engine, &prompt);
    let (lc, _) = prompt_logits(&mut cpu.engine, &prompt);
    let max = lc.iter().fold(0f32, |a, v| a.max(v.abs()));
    let worst = lg.iter().zip(&lc).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(worst <= 0.02 * max, "prompt logits differ by {worst} (largest logit {max})");
    // A KV export out of VRAM holds what the CPU computed, within f16 and kernel rounding.
    let export = |e: &mut pdmesh_engine::Engine| {
        let id = e.add_sequence(prompt.clone(), greedy(1)).unwrap();
        while e.forward_pending(&[id], 512, Default::default()).unwrap().is_empty() {}
        let blob = e.export_kv(id).unwrap();
        e.release(id).unwrap();
        blob
    };
    let (bg, bc) = (export(&mut gpu.engine), export(&mut cpu.engine));
    assert_eq!((bg.n_tokens, bg.bytes.len()), (bc.n_tokens, bc.bytes.len()));
    let f = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    let worst =
        bg.bytes.chunks_exact(2).zip(bc.bytes.chunks_exact(2)).map(|(a, b)| (f(a) - f(b)).abs()).fold(0f32, f32::max);
    assert!(worst < 0.1, "KV differs by up to {worst}");
}

#[test]
fn cuda_graph_replay_equals_launching_every_kernel() {
    let Some(mut gpu) = gpu_engine("cuda_graph_replay_equals_launching_every_kernel") else { return };
    let prompts: Vec<Vec<u32>> = golden().iter().map(|g| ids(&g["chat_ids"])).collect();
    let replayed = gpu.engine.generate_all(&prompts, &greedy(24), 8).unwrap();
    gpu.engine.set_cuda_graphs(false);
    let launched = gpu.engine.generate_all(&prompts, &greedy(24), 8).unwrap();
    assert_eq!(
        replayed, launched,
        "decode steps from CUDA graphs differ from the same steps launched kernel by kernel"
    );
}

#[test]
fn cuda_device_picked_tokens_equal_the_hosts_argmax_of_the_same_logits() {
    let test = "cuda_device_picked_tokens_equal_the_hosts_argmax_of_the_same_logits";
    let Some(mut gpu) = gpu_engine(test) else { return };
    let prompts: Vec<Vec<u32>> = golden().iter().map(|g| ids(&g["chat_ids"])).collect();
    // Graph steps and launched steps, each with ids picked on the device
    // and with every row's logits brought to the host's sampler.
    for graphs in [true, false] {
        gpu.engine.set_cuda_graphs(graphs);
        gpu.engine.set_device_sampling(true);
        let picked = gpu.engine.generate_all(&prompts, &greedy(24), 8).unwrap();
        gpu.engine.set_device_sampling(false);
        let sampled = gpu.engine.generate_all(&prompts, &greedy(24), 8).unwrap();
        assert_eq!(picked, sampled, "device argmax differs from the host's (graphs {graphs})");
    }
}

/// Kernel spans as a subscriber sees them: each one's device time and name.
#[derive(Clone, Default)]
struct KernelSpans(Arc<Mutex<Vec<DeviceMs>>>);

#[derive(Clone)]
struct DeviceMs(Option<f64>, String);

impl tracing::field::Visit for DeviceMs {
    fn record_f64(&mut self, f: &tracing::field::Field, v: f64) {
        if f.name() == kernel_attr::DEVICE_MS {
            self.0 = Some(v);
        }
    }

    fn record_str(&mut self, f: &tracing::field::Field, v: &str) {
        if f.name() == "otel.name" {
            self.1 = v.to_string();
        }
    }

    fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
}

impl<S> tracing_subscriber::Layer<S> for KernelSpans
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_new_span(
        &self,
        a: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if a.metadata().name() != kernel_attr::SPAN {
            return;
        }
        let mut v = DeviceMs(None, String::new());
        a.record(&mut v);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(Mutex::new(v));
        }
    }

    fn on_record(
        &self,
        id: &tracing::span::Id,
        r: &tracing::span::Record<'_>,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if let Some(span) = ctx.span(id) {
            if let Some(v) = span.extensions().get::<Mutex<DeviceMs>>() {
                r.record(&mut *v.lock().unwrap_or_else(|e| e.into_inner()));
            }
        }
    }

    fn on_close(&self, id: tracing::span::Id, ctx: tracing_subscriber::layer::Context<'_, S>) {
        if let Some(span) = ctx.span(&id) {
            if let Some(v) = span.extensions().get::<Mutex<DeviceMs>>() {
                let v = v.lock().unwrap_or_else(|e| e.into_inner());
                self.0.lock().unwrap_or_else(|e| e.into_inner()).push(v.clone());
            }
        }
    }
}

/// A traced step (kernel spans on, a subscriber taking every span, as an
/// exporter does) runs, and every launch's span carries its device time.
/// The first GPU run failed every such step: cudarc's `new_event(None)`
/// makes events without timing.
#[test]
fn cuda_traced_steps_record_device_time_on_every_kernel_span() {
    use tracing_subscriber::layer::SubscriberExt;
    let Some(mut gpu) = gpu_engine("cuda_traced_steps_record_device_time_on_every_kernel_span") else { return };
    let seen = KernelSpans::default();
    let subscriber = tracing_subscriber::registry().with(seen.clone());
    let prompt = ids(&golden()[0]["chat_ids"]);
    tracing::subscriber::with_default(subscriber, || {
        let _step = tracing::info_span!("decode_step").entered();
        let e = &mut gpu.engine;
        let id = e.add_sequence(prompt.clone(), greedy(4)).unwrap();
        let traced = StepOptions { kernel_spans: true };
        // The prompt's step, then decode steps (which would replay graphs untraced).
        for _ in 0..4 {
            for (sid, next) in e.forward_some(&[(id, e.pending(id).unwrap().max(1))], traced).unwrap() {
                e.accept(sid, &next).unwrap();
            }
        }
        e.release(id).unwrap();
    });
    let spans = seen.0.lock().unwrap();
    assert!(spans.len() > 30 * 4, "only {} kernel spans", spans.len());
    let untimed: Vec<&String> = spans.iter().filter(|k| !k.0.is_some_and(|m| m > 0.0)).map(|k| &k.1).collect();
    let first: Vec<&&String> = untimed.iter().take(5).collect();
    assert!(
        untimed.is_empty(),
        "{} of {} kernel spans without device time, first {first:?}",
        untimed.len(),
        spans.len()
    );
}
