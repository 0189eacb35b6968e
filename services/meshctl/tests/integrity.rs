//! KV integrity: every transferred block carries the sender's CRC-32C and
//! the decode worker checks its blocks before the first decode step. A
//! test-only switch (`prefill.kv_corrupt`, `--enable-fault-injection`)
//! flips one byte of the next N transfers after their checksums were taken:
//! over TCP in the streamed copy, over NIXL in the source block the
//! one-sided write reads. Either way the answer must stay the golden one,
//! and the metrics must count each corruption:
//! - one corrupt transfer: the router transfers the prompt again;
//! - two in a row: the decode worker prefills the prompt itself.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{chat_request, golden, ids, run, Mesh};
use pdmesh_core::http::metric;
use pdmesh_core::vocab::metric as m;

async fn counter(mesh: &Mesh, service: &str, name: &str) -> f64 {
    metric(&mesh.metrics(service).await, name).unwrap_or(0.0)
}

/// The golden prompt's greedy answer (32 tokens, EOS ignored) equals llama.cpp's.
async fn golden_answer(mesh: &Mesh) {
    let g = &golden()[0];
    let mut r = mesh.router().await;
    let o = run(&mut r, chat_request(g["prompt"].as_str().unwrap(), 32, true)).await.expect("request");
    assert_eq!(o.ids, ids(&g["greedy_ids_32_ignore_eos"]), "the answer is the golden one");
}

async fn corruption_is_caught(transport: &str) {
    let mesh = Mesh::up(&["--enable-fault-injection", "--kv-transport", transport]);
    golden_answer(&mesh).await;
    let moved = format!("{}{{transport=\"{transport}\"}}", m::prefill::KV_TRANSFERS_TOTAL);
    assert_eq!(counter(&mesh, "prefill", &moved).await, 1.0, "the prompt went over {transport}");
    assert_eq!(counter(&mesh, "decode", m::decode::KV_CORRUPT_TOTAL).await, 0.0, "a clean transfer passes its check");

    // One corrupt transfer: caught, transferred again, answer intact.
    mesh.fault("prefill", "prefill.kv_corrupt", 1).await;
    golden_answer(&mesh).await;
    assert_eq!(counter(&mesh, "decode", m::decode::KV_CORRUPT_TOTAL).await, 1.0);
    assert_eq!(counter(&mesh, "router", m::router::KV_CORRUPT_RETRIES_TOTAL).await, 1.0);
    assert_eq!(counter(&mesh, "prefill", &moved).await, 3.0, "the retry transferred the prompt again");

    // Two in a row: the second retry has the decode worker prefill itself.
    let local_before = counter(&mesh, "decode", m::decode::LOCAL_PREFILLS_TOTAL).await;
    mesh.fault("prefill", "prefill.kv_corrupt", 2).await;
    golden_answer(&mesh).await;
    assert_eq!(counter(&mesh, "decode", m::decode::KV_CORRUPT_TOTAL).await, 3.0);
    assert_eq!(counter(&mesh, "router", m::router::KV_CORRUPT_RETRIES_TOTAL).await, 3.0);
    assert_eq!(counter(&mesh, "decode", m::decode::LOCAL_PREFILLS_TOTAL).await, local_before + 1.0, "re-prefilled");
    assert_eq!(counter(&mesh, "prefill", &moved).await, 5.0);
    mesh.assert_released(Duration::from_secs(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_byte_flipped_over_tcp_is_caught_and_the_answer_stays_right() {
    corruption_is_caught("tcp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_byte_flipped_over_nixl_is_caught_and_the_answer_stays_right() {
    if pdmesh_worker::kv::find_library(None, "python3").is_none() {
        pdmesh_testkit::skip("nixl byte flip", "libnixl_capi.so not found (pip install nixl-cu12==1.5.1)");
        return;
    }
    corruption_is_caught("nixl").await;
}
