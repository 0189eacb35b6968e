#!/usr/bin/env python3
"""Soak: a whole mesh under steady load for a long time, watching for leaks.

Starts `meshctl up`, drives it with `pdmesh-loadtest` (closed loop, unique
prompts so the prefix cache keeps filling and evicting) plus a trickle of
clients that hang up mid-stream, and samples every process of the mesh
(resident memory and open file descriptors, from /proc) at a fixed period.
Prints JSON: the samples, and per service the figures at the end of the
warm-up and at the end, with their growth. Not run in CI (it takes the
whole --minutes); results go to docs/benchmarks/.

    python3 scripts/soak.py [--minutes 30] [--warmup-minutes 5] [--period-s 30]
                            [--concurrency 8] [--out FILE]

Growth is judged after warm-up (allocators, caches and thread pools settle
first); the report says which services grew more than --max-growth-pct.
Exit status 1 if any did, or if a service restarted during the run.
"""
import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

BIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "target", "release")


def instances(parent):
    """(kind, id, pid) of every service process `meshctl up` (pid `parent`) runs."""
    out = []
    try:
        tasks = os.listdir(f"/proc/{parent}/task")
    except OSError:
        return out
    kids = set()
    for t in tasks:
        try:
            kids.update(int(p) for p in open(f"/proc/{parent}/task/{t}/children").read().split())
        except OSError:
            pass
    for pid in sorted(kids):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        argv = [a.decode(errors="replace") for a in argv]
        kind = os.path.basename(argv[0]).removeprefix("pdmesh-")
        iid = argv[argv.index("--instance-id") + 1] if "--instance-id" in argv else f"{kind}-{pid}"
        out.append((kind, iid, pid))
    return out


def proc_sample(pid):
    """Resident set (KiB) and open fds of a process, or None if it is gone."""
    try:
        rss = next(int(l.split()[1]) for l in open(f"/proc/{pid}/status") if l.startswith("VmRSS:"))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        threads = len(os.listdir(f"/proc/{pid}/task"))
    except (OSError, StopIteration):
        return None
    return {"rss_kib": rss, "fds": fds, "threads": threads}


def hang_ups(gateway, stop, counts):
    """Every 2 s, a streamed request whose client leaves after 0.3 s."""
    body = json.dumps({"model": "m", "stream": True, "max_tokens": 64,
                       "messages": [{"role": "user", "content": "Tell me a long story about the sea."}]}).encode()
    host, port = gateway.rsplit(":", 1)
    while not stop.wait(2.0):
        try:
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(0.3)
            s.close()
            counts["hang_ups"] += 1
        except OSError:
            counts["hang_up_errors"] += 1


def growth(a, b):
    return round(100.0 * (b - a) / a, 2) if a else None


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--warmup-minutes", type=float, default=5.0)
    p.add_argument("--period-s", type=float, default=30.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-growth-pct", type=float, default=5.0)
    p.add_argument("--gateway-addr", default="127.0.0.1:18380")
    p.add_argument("--out", help="also write the JSON here")
    a = p.parse_args()

    work = tempfile.mkdtemp(prefix="pdmesh-soak-")
    registry = os.path.join(work, "registry")
    up_log = open(os.path.join(work, "up.log"), "w")
    up = subprocess.Popen([os.path.join(BIN, "meshctl"), "up", "--gateway-addr", a.gateway_addr,
                           "--registry-dir", registry], stdout=up_log, stderr=subprocess.STDOUT)
    try:
        report = run(a, work, registry, up)
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
    text = json.dumps(report, indent=1)
    print(text)
    if a.out:
        open(a.out, "w").write(text + "\n")
    sys.exit(0 if report["verdict"]["ok"] else 1)


def run(a, work, registry, up):
    t0 = time.time()
    while not any("pdmesh is up" in l for l in open(os.path.join(work, "up.log"))):
        if up.poll() is not None or time.time() - t0 > 900:
            raise SystemExit(f"meshctl up did not come up; see {work}/up.log")
        time.sleep(0.5)
    load_out = os.path.join(work, "load.json")
    load = subprocess.Popen([os.path.join(BIN, "pdmesh-loadtest"), "--target", a.gateway_addr, "--mode", "closed",
                             "--concurrency", str(a.concurrency), "--requests", "100000", "--unique-prompts",
                             "--max-tokens", "48", "--max-point-s", str(a.minutes * 60), "--out", load_out],
                            stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "load.log"), "w"))
    stop, counts = threading.Event(), {"hang_ups": 0, "hang_up_errors": 0}
    hanger = threading.Thread(target=hang_ups, args=(a.gateway_addr, stop, counts), daemon=True)
    hanger.start()
    samples, pids = [], {}
    start = time.time()
    while time.time() - start < a.minutes * 60:
        row = {"t_s": round(time.time() - start, 1), "procs": {}}
        for kind, iid, pid in instances(up.pid):
            pids.setdefault(iid, set()).add(pid)
            s = proc_sample(pid)
            if s:
                row["procs"][iid] = dict(s, kind=kind, pid=pid)
        m = proc_sample(up.pid)
        if m:
            row["procs"]["meshctl"] = dict(m, kind="meshctl", pid=up.pid)
        samples.append(row)
        time.sleep(max(0.0, a.period_s - (time.time() - start - row["t_s"])))
    stop.set()
    load.send_signal(signal.SIGINT)
    load.wait(120)
    try:
        point = json.load(open(load_out))["points"][0]
        load_summary = {k: point.get(k) for k in ("requests", "ok", "errors", "stalled", "output_tokens_per_s")}
    except (OSError, ValueError, KeyError, IndexError):
        load_summary = {"error": "no loadtest report"}
    return summarize(a, samples, pids, load_summary, counts)


def summarize(a, samples, pids, load_summary, counts):
    warm = next((s for s in samples if s["t_s"] >= a.warmup_minutes * 60), samples[0])
    last = samples[-1]
    services, grew = {}, []
    for iid, w in warm["procs"].items():
        e = last["procs"].get(iid)
        if not e:
            continue
        g = {"rss": growth(w["rss_kib"], e["rss_kib"]), "fds": growth(w["fds"], e["fds"])}
        peak = max(s["procs"][iid]["rss_kib"] for s in samples if iid in s["procs"] and s["t_s"] >= warm["t_s"])
        services[iid] = {"kind": w["kind"], "after_warmup": {k: w[k] for k in ("rss_kib", "fds", "threads")},
                         "end": {k: e[k] for k in ("rss_kib", "fds", "threads")}, "peak_rss_kib": peak,
                         "growth_pct": g}
        if any(v is not None and v > a.max_growth_pct for v in g.values()):
            grew.append(iid)
    restarted = sorted(i for i, p in pids.items() if len(p) > 1)
    flags = [f for f in ("avx512f", "avx2", "fma") if f in open("/proc/cpuinfo").read()]
    return {
        "bench": "soak",
        "date": time.strftime("%Y-%m-%d"),
        "command": "python3 scripts/soak.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "flags": flags, "kernel": platform.release()},
        "minutes": a.minutes, "warmup_minutes": a.warmup_minutes, "period_s": a.period_s,
        "load": dict(load_summary, concurrency=a.concurrency, **counts),
        "services": services,
        "verdict": {"ok": not grew and not restarted, "max_growth_pct": a.max_growth_pct,
                    "grew": grew, "restarted": restarted},
        "samples": samples,
    }


if __name__ == "__main__":
    main()
