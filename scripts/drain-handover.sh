#!/usr/bin/env bash
# A decode worker drained with 8 running sequences, handing them over with
# their KV shipped along against replaying their tokens elsewhere: the two
# drain tests of services/meshctl/tests/drain.rs run alternately (kv,
# replay, kv, replay ...), ROUNDS times, over TRANSPORT (auto: NIXL where it
# loads; tcp). Prints each run's JSON line, then a summary as JSON: the
# drain's time (notice of 1 s included) and each request's stall (its
# longest wait between two tokens), median and max over the 8.
#
#   bash scripts/drain-handover.sh [ROUNDS] [TRANSPORT]
#   bash scripts/drain-handover.sh 3 auto
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
transport=${2:-auto}
cargo build --release --workspace --all-targets >&2
lines=$(mktemp)
for _ in $(seq 1 "$rounds"); do
  for mode in ships_their_kv hands_them_over_for_replay; do
    PDMESH_KV_TRANSPORT=$transport cargo test --release -p pdmesh-meshctl --test drain -- --exact \
      "a_decode_drained_with_8_running_sequences_${mode}_and_leaves_in_seconds" --nocapture 2>&1 \
      | grep '^{"drain_8_sequences_s"' | tee -a "$lines"
  done
done
python3 - "$lines" "$transport" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
out = {"transport": sys.argv[2], "rounds": len(runs) // 2}
for mode in ("kv", "replay"):
    r = [x for x in runs if x["handover"] == mode]
    out[mode] = {
        "drain_s": [x["drain_8_sequences_s"] for x in r],
        "stall_median_s": [x["stall_s"]["median"] for x in r],
        "stall_max_s": [x["stall_s"]["max"] for x in r],
    }
kv, rp = out["kv"], out["replay"]
out["stall_median_ratio_replay_over_kv"] = round(
    statistics.median(rp["stall_median_s"]) / max(statistics.median(kv["stall_median_s"]), 1e-9), 1)
print(json.dumps(out))
PY
