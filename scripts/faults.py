#!/usr/bin/env python3
"""Gray-failure drills (issue 43): each phase brings up a fresh mesh on
loopback, runs a closed-loop load through the gateway, injects one fault
3 s in (for 10 s, or a kill), and prints one JSON line: failed, stalled,
output tok/s, e2e p50/p90/p99, TTFT p90, the longest any stream went
without a token, and whether greedy requests sent during the fault got the
same text as before it.

Every phase has the same shape: 1 router (2 for the double kill), 2
prefill workers, 2 decode workers, --threads 1, --router-policy
least-busy (so the faulted worker carries its half), meshctl's defaults
otherwise: the decode workers prefill these short prompts themselves,
except in the phases named for prefill and `none-remote` (their
baseline), where every prompt goes through a prefill worker
(--max-local-prefill 0). decode-0 is meshctl's; decode-x is a
copy of its command line started here behind `pdmesh-faultproxy`
(--advertise-addr), so its link can be delayed, blackholed or reset.

  python3 scripts/faults.py [--phases a,b,...] [--rounds N] [--before]

  --before   also run each phase with the router's stall detection off
             (PDMESH_ROUTER_STALL_FLOOR_MS=600000): the old behaviour,
             interleaved with the new (before, after, before, after ...).

Phases: none, none-remote, sigstop-decode, blackhole-decode, delay-decode (300 ms per
chunk), sigstop-prefill, double-kill (router-0 and decode-0 SIGKILL within
1 s; meshctl restarts them), stop-prefill+blackhole-decode.
Bounded: each phase's load has 48 requests and a 30 s client stall limit.
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release")
PHASES = ["none", "none-remote", "sigstop-decode", "blackhole-decode", "delay-decode", "sigstop-prefill", "double-kill",
          "stop-prefill+blackhole-decode"]
FAULT_AT, FAULT_FOR = 3.0, 10.0
CLIENTS, REQUESTS, TOKENS = 8, 48, 48
GREEDY = ["Name three rivers in Europe.", "Why is the sky blue?", "Write a haiku about rain."]


def port():
    return random.randint(20000, 45000)


def addr():
    return f"127.0.0.1:{port()}"


def http(address, path, body=None, timeout=5):
    req = urllib.request.Request(f"http://{address}{path}", data=body,
                                 headers={"Content-Type": "application/json"} if body else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read().decode()


def proxy_mode(ctl, mode):
    host, p = ctl.split(":")
    import socket
    with socket.create_connection((host, int(p)), timeout=5) as s:
        s.sendall((mode + "\n").encode())
        return s.recv(200).decode().strip()


class Mesh:
    def __init__(self, routers, before, remote):
        self.dir = tempfile.mkdtemp(prefix="pdmesh-faults-")
        self.reg = os.path.join(self.dir, "registry")
        self.gateway = addr()
        env = dict(os.environ)
        if before:
            env["PDMESH_ROUTER_STALL_FLOOR_MS"] = "600000"
        self.env = env
        out = open(os.path.join(self.dir, "up.out"), "w")
        self.up = subprocess.Popen(
            [os.path.join(BIN, "meshctl"), "up", "--gateway-addr", self.gateway, "--registry-dir", self.reg,
             "--router-policy", "least-busy", *self.jaeger_flags(),
             "--log-dir", os.path.join(self.dir, "logs"), "--threads", "1",
             "--max-local-prefill", "0" if remote else "256",
             "--prefill-replicas", "2", "--router-replicas", str(routers), "--drain-notice-ms", "300"],
            stdout=out, stderr=subprocess.STDOUT, env=env)
        t0 = time.time()
        while "pdmesh is up" not in open(os.path.join(self.dir, "up.out")).read():
            if self.up.poll() is not None or time.time() - t0 > 300:
                sys.exit("meshctl up failed:\n" + open(os.path.join(self.dir, "up.out")).read()[-3000:])
            time.sleep(0.5)
        self.extra = []
        self.start_proxied_decode()

    def jaeger_flags(self):
        """PDMESH_FAULTS_JAEGER=HOST:PORT: trace every request into a Jaeger
        there (`meshctl explain` then says where a slow one's time went)."""
        ui = os.environ.get("PDMESH_FAULTS_JAEGER")
        return ["--jaeger", "--jaeger-ui-addr", ui] if ui else []

    def instances(self, service):
        out = subprocess.run([os.path.join(BIN, "meshctl"), "status", "--json", "--registry-dir", self.reg],
                             capture_output=True, text=True, check=True).stdout
        return [i for i in json.loads(out)["instances"] if i["service"] == service]

    def pid(self, instance_id):
        for s in ["decode", "prefill", "router"]:
            for i in self.instances(s):
                if i["id"] == instance_id:
                    return json.loads(http(i["http_addr"], "/statusz")[1])["pid"]
        raise SystemExit(f"{instance_id} is not live")

    def start_proxied_decode(self):
        """decode-x: decode-0's command line and environment, on new ports, behind a fault proxy."""
        pid = self.pid("decode-0")
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[:-1]
        env = dict(kv.split(b"=", 1) for kv in open(f"/proc/{pid}/environ", "rb").read().split(b"\0") if b"=" in kv)
        listen, self.proxy, self.ctl, http_addr = addr(), addr(), addr(), addr()
        swap = {b"--listen": listen, b"--http-listen": http_addr, b"--instance-id": "decode-x"}
        argv = [a.decode() for a in argv]
        for i, a in enumerate(argv[:-1]):
            if a.encode() in swap:
                argv[i + 1] = swap[a.encode()]
        argv += ["--advertise-addr", self.proxy]
        log = open(os.path.join(self.dir, "decode-x.log"), "w")
        self.extra.append(subprocess.Popen([os.path.join(BIN, "pdmesh-faultproxy"), self.proxy, listen, self.ctl],
                                           stdout=log, stderr=log))
        self.decode_x = subprocess.Popen(argv, env={k.decode(): v.decode() for k, v in env.items()},
                                         stdout=log, stderr=log)
        self.extra.append(self.decode_x)
        t0 = time.time()
        while not any(i["id"] == "decode-x" and i["health"] == "healthy" for i in self.instances("decode")):
            if time.time() - t0 > 120:
                raise SystemExit("decode-x did not come up: see " + log.name)
            time.sleep(0.5)

    def stop(self):
        for p in self.extra:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
        self.up.send_signal(signal.SIGTERM)
        self.up.wait(timeout=120)
        for p in self.extra:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def chat(gateway, prompt):
    body = json.dumps({"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": 32, "temperature": 0}).encode()
    try:
        st, text = http(gateway, "/v1/chat/completions", body, timeout=120)
        return json.loads(text)["choices"][0]["message"]["content"] if st == 200 else None
    except Exception:  # an error is a mismatch, counted
        return None


def fault(mesh, phase):
    """Inject `phase`'s fault now; returns how to undo it (or None)."""
    def stop(ids):
        pids = [mesh.pid(i) for i in ids]
        for p in pids:
            os.kill(p, signal.SIGSTOP)
        return lambda: [os.kill(p, signal.SIGCONT) for p in pids]
    if phase == "sigstop-decode":
        return stop(["decode-x"])
    if phase == "sigstop-prefill":
        return stop(["prefill-1"])
    if phase in ("blackhole-decode", "delay-decode"):
        proxy_mode(mesh.ctl, "blackhole" if phase == "blackhole-decode" else "delay 300")
        return lambda: proxy_mode(mesh.ctl, "pass")
    if phase == "stop-prefill+blackhole-decode":
        cont = stop(["prefill-1"])
        proxy_mode(mesh.ctl, "blackhole")
        return lambda: (cont(), proxy_mode(mesh.ctl, "pass"))
    if phase == "double-kill":
        a, b = mesh.pid("router-0"), mesh.pid("decode-0")
        os.kill(a, signal.SIGKILL)
        time.sleep(0.5)
        os.kill(b, signal.SIGKILL)
        return None
    return None


def run_phase(phase, before):
    mesh = Mesh(2 if phase == "double-kill" else 1, before, "prefill" in phase or phase == "none-remote")
    try:
        reference = [chat(mesh.gateway, p) for p in GREEDY]
        lt = [os.path.join(BIN, "pdmesh-loadtest"), "--target", mesh.gateway, "--concurrency", str(CLIENTS),
              "--ignore-eos", "--markdown", "/dev/null", "--stall-s", "30"]
        subprocess.run(lt + ["--requests", str(CLIENTS), "--max-tokens", "8", "--out", "/dev/null"],
                       check=True, capture_output=True)
        report = os.path.join(mesh.dir, "run.json")
        load = subprocess.Popen(lt + ["--requests", str(REQUESTS), "--max-tokens", str(TOKENS), "--out", report],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(FAULT_AT)
        undo = fault(mesh, phase)
        # Greedy requests while the fault holds: their text must equal the reference.
        greedy = []
        t = threading.Thread(target=lambda: greedy.extend(chat(mesh.gateway, p) for p in GREEDY))
        t.start()
        time.sleep(FAULT_FOR)
        if undo:
            undo()
        t.join()
        load.wait(timeout=600)
        p = json.load(open(report))
        p = p["points"][0] if isinstance(p, dict) and "points" in p else p[0]
        q = lambda k, x: round(p[k][x], 3) if p.get(k) else None
        return {
            "phase": phase, "stall_detection": not before, "failed": p["errors"], "stalled": p["stalled"],
            "output_tok_s": round(p["output_tokens_per_s"], 1),
            "e2e_s": {"p50": q("e2e_s", "p50"), "p90": q("e2e_s", "p90"), "p99": q("e2e_s", "p99")},
            "ttft_p90_s": q("ttft_s", "p90"), "longest_gap_s": round(p["longest_gap_s"], 3),
            "greedy_equal": f"{sum(a == b and a is not None for a, b in zip(greedy, reference))}/{len(GREEDY)}",
        }
    finally:
        mesh.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--before", action="store_true")
    a = ap.parse_args()
    phases = a.phases.split(",")
    for p in phases:
        if p not in PHASES:
            sys.exit(f"unknown phase {p} ({', '.join(PHASES)})")
    subprocess.run(["cargo", "build", "--release", "--workspace", "--bins"], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)
    for _ in range(a.rounds):
        for p in phases:
            for before in ([True, False] if a.before else [False]):
                print(json.dumps(run_phase(p, before)), flush=True)


if __name__ == "__main__":
    main()
