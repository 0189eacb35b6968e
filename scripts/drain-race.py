#!/usr/bin/env python3
"""A request sent while the mesh's only prefill worker drains, at every
point of the drain: the race behind the one-time 300 s wait of prefix.rs's
with_no_prefill_worker_left_the_decode_worker_prefills_any_prompt (issue 29).

One `meshctl up --max-local-prefill 1` (every prompt would go to a prefill
worker). Each round: `meshctl scale prefill=1` brings a prefill worker up,
it is SIGTERMed, and after OFFSET ms one ~100-token chat request goes
through the gateway. Each request must end, 200, well before its deadline;
the script prints one JSON line per round and a summary (max seconds per
offset, failures) and exits 1 on any failure or any answer slower than
--slow-s.

    python3 scripts/drain-race.py [--rounds 3] [--offsets 0,50,...] [--slow-s 10]

Needs a release build (cargo build --release --workspace) and the model
(target/release/pdmesh-engine fetch).
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHCTL = os.path.join(ROOT, "target", "release", "meshctl")
PROMPT = (
    "Log {n}: a lighthouse keeper writes in her log every evening. She notes the wind, the swell, the ships "
    "that passed, the colour of the sky at dusk and the state of the lamp. Summarise tonight's entry, in "
    "which a fishing boat came in late under a red sky and the lamp needed a new wick."
)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def prefill_pids(registry):
    """(pid, http address) of each prefill entry in the file registry."""
    out = []
    d = os.path.join(registry, "prefill")
    for f in os.listdir(d) if os.path.isdir(d) else []:
        if not f.endswith(".json"):
            continue
        try:
            entry = json.load(open(os.path.join(d, f)))
            http = entry["instance"]["http_addr"]
            status = json.load(urllib.request.urlopen(f"http://{http}/statusz", timeout=2))
            out.append(status["pid"])
        except (OSError, ValueError, KeyError):
            pass
    return out


def ask(gateway, n, deadline_s):
    body = json.dumps(
        {"model": "smollm2-135m-instruct", "max_tokens": 4, "messages": [{"role": "user", "content": PROMPT.format(n=n)}]}
    ).encode()
    req = urllib.request.Request(
        f"http://{gateway}/v1/chat/completions", data=body, headers={"content-type": "application/json"}
    )
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=deadline_s + 30) as r:
            r.read()
            code = r.status
    except urllib.error.HTTPError as e:
        code = e.code
    except OSError as e:
        code = f"client: {e}"
    return code, time.monotonic() - t0


def meshctl(registry, *args):
    return subprocess.run(
        [MESHCTL, *args, "--registry-dir", registry], capture_output=True, text=True, timeout=120
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--offsets", default="0,25,50,100,200,300,400,500,700,1000,1500,2500")
    ap.add_argument("--slow-s", type=float, default=10.0)
    ap.add_argument("--deadline-s", type=int, default=120)
    a = ap.parse_args()
    offsets = [int(x) for x in a.offsets.split(",")]
    work = tempfile.mkdtemp(prefix="pdmesh-drain-race-")
    registry = os.path.join(work, "registry")
    gateway = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, PDMESH_GATEWAY_REQUEST_TIMEOUT_S=str(a.deadline_s),
               PDMESH_ROUTER_REQUEST_TIMEOUT_S=str(a.deadline_s))
    up = subprocess.Popen(
        [MESHCTL, "up", "--gateway-addr", gateway, "--registry-dir", registry, "--log-dir",
         os.path.join(work, "logs"), "--max-local-prefill", "1", "--no-restart", "--drain-notice-ms", "300",
         "--threads", "1"],
        stdout=subprocess.PIPE, stderr=open(os.path.join(work, "meshctl.log"), "w"), text=True, env=env,
    )
    if not any("pdmesh is up" in line for line in up.stdout):
        sys.exit(f"the mesh did not come up: see {work}/meshctl.log")
    rows, bad = [], 0
    try:
        n = 0
        for r in range(a.rounds):
            for off in offsets:
                n += 1
                pids = prefill_pids(registry)
                t0 = time.monotonic()
                while not pids and time.monotonic() - t0 < 60:
                    # meshctl books the last one's exit within a moment; until
                    # then it counts it, and scale starts nothing.
                    meshctl(registry, "scale", "prefill=1")
                    time.sleep(2)
                    pids = prefill_pids(registry)
                if not pids:
                    sys.exit(f"meshctl scale prefill=1 brought no prefill worker up: see {work}/meshctl.log")
                time.sleep(0.7)  # the router's registry poll (0.3 s) has seen it
                os.kill(pids[0], signal.SIGTERM)
                time.sleep(off / 1000)
                code, secs = ask(gateway, n, a.deadline_s)
                ok = code == 200 and secs < a.slow_s
                bad += not ok
                row = {"round": r, "offset_ms": off, "status": code, "seconds": round(secs, 3), "ok": ok}
                rows.append(row)
                print(json.dumps(row), flush=True)
                t0 = time.monotonic()
                while prefill_pids(registry) and time.monotonic() - t0 < 30:
                    time.sleep(0.2)
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
    by = {}
    for row in rows:
        by.setdefault(row["offset_ms"], []).append(row["seconds"])
    print(json.dumps({"requests": len(rows), "failed_or_slow": bad, "logs": os.path.join(work, "logs"),
                      "max_seconds_by_offset_ms": {k: max(v) for k, v in sorted(by.items())}}))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
