#!/usr/bin/env python3
"""gpu-check's side-by-side table: pdmesh against llama.cpp's CUDA build on
one GPU, in one run, rounds interleaved (pdmesh, llama.cpp, pdmesh, ...).

    gpu_side_by_side.py OUT_DIR

reads from OUT_DIR what scripts/gpu-check.sh wrote:
  bench-<r>.json     pdmesh-engine bench --backend cuda (round r)
  llama-bench-<r>.json   llama-bench -o json (pp512, tg128)
  batched-<r>.txt    llama-batched-bench's table (-npp 128 -ntg 64 -npl 1,8,32,64)
  mesh.json          pdmesh-loadtest on a mesh on the GPU (concurrency 64, 96)
and writes OUT_DIR/side-by-side.json and side-by-side.md. Each figure is the
median over rounds, with its range; the ratio is pdmesh / llama.cpp, and the
targets are the issue's: at least 1.0x everywhere, the mesh at least 0.8x
the engine alone at batch 64 with TTFT p90 at most 100 ms at c=64.
"""
import glob
import json
import os
import statistics
import sys


def rounds(out, pattern, read):
    return [read(p) for p in sorted(glob.glob(os.path.join(out, pattern)))]


def pdmesh_figures(path):
    d = json.load(open(path))
    run = d["runs"][0] if "runs" in d else d
    figs = {"prefill_512": run["prefill_tokens_per_s"]}
    for x in run.get("decode", []):
        figs[f"decode_b{x['batch']}"] = x["tokens_per_s"]
    return figs


def llama_bench_figures(path):
    figs = {}
    for x in json.load(open(path)):
        if x.get("n_prompt") == 512 and x.get("n_gen") == 0:
            figs["prefill_512"] = x["avg_ts"]
        if x.get("n_gen") == 128 and x.get("n_prompt") == 0:
            figs["decode_b1_tg128"] = x["avg_ts"]
    return figs


def batched_figures(path):
    """Rows of llama-batched-bench's markdown table: S_TG t/s by batch B."""
    figs, header = {}, None
    for line in open(path):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "B" in cells and "S_TG t/s" in cells:
            header = cells
            continue
        if header and len(cells) == len(header):
            try:
                row = dict(zip(header, (float(c) for c in cells)))
            except ValueError:
                continue
            figs[f"decode_b{int(row['B'])}"] = row["S_TG t/s"]
            if int(row["B"]) == 1:
                figs["prefill_128_batched"] = row["S_PP t/s"]
    return figs


def summary(values):
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def collect(per_round):
    keys = sorted({k for r in per_round for k in r})
    return {k: summary([r[k] for r in per_round if k in r]) for k in keys}


def mesh_figures(path):
    if not os.path.exists(path):
        return {}
    d = json.load(open(path))
    out = {}
    for p in d.get("points", []):
        c = int(p["concurrency"])
        ttft = p.get("ttft_s", {})
        out[c] = {"output_tokens_per_s": p["output_tokens_per_s"], "ttft_p90_s": ttft.get("p90"), "errors": p["errors"]}
    return out


def table(out):
    pd = collect(rounds(out, "bench-*.json", pdmesh_figures))
    lb = collect(rounds(out, "llama-bench-*.json", llama_bench_figures))
    bb = collect(rounds(out, "batched-*.txt", batched_figures))
    rows = []

    def row(name, ours, theirs, theirs_from):
        a, b = pd.get(ours), theirs
        ratio = a["median"] / b["median"] if a and b and b["median"] else None
        rows.append({"figure": name, "pdmesh": a, "llama_cpp": b, "llama_cpp_from": theirs_from,
                     "ratio": ratio, "target": 1.0, "met": ratio is not None and ratio >= 1.0})

    row("prefill, 512 tokens (tok/s)", "prefill_512", lb.get("prefill_512"), "llama-bench pp512")
    # Batch 1: the better of llama-bench's tg128 and batched-bench's B=1.
    b1 = [x for x in (lb.get("decode_b1_tg128"), bb.get("decode_b1")) if x]
    row("decode, batch 1 (tok/s)", "decode_b1", max(b1, key=lambda x: x["median"]) if b1 else None,
        "best of llama-bench tg128 and llama-batched-bench B=1")
    for b in (8, 32, 64):
        row(f"decode, batch {b} (tok/s)", f"decode_b{b}", bb.get(f"decode_b{b}"), f"llama-batched-bench B={b}")
    mesh = mesh_figures(os.path.join(out, "mesh.json"))
    engine64 = pd.get("decode_b64")
    m64 = mesh.get(64)
    mesh_row = None
    if m64 and engine64:
        share = m64["output_tokens_per_s"] / engine64["median"]
        ttft = m64["ttft_p90_s"]
        mesh_row = {"mesh_c64_tokens_per_s": m64["output_tokens_per_s"], "engine_b64_tokens_per_s": engine64["median"],
                    "share": share, "share_target": 0.8, "ttft_p90_s": ttft, "ttft_target_s": 0.1,
                    "met": share >= 0.8 and ttft is not None and ttft <= 0.1}
    kv = os.path.join(out, "kv-vram.json")
    kv = json.load(open(kv)) if os.path.exists(kv) else None
    return {"rows": rows, "mesh": mesh_row, "kv_vram": kv, "mesh_levels": mesh, "pdmesh": pd, "llama_bench": lb, "batched": bb}


def fmt(s):
    if not s:
        return "not run"
    if s["n"] == 1 or s["min"] == s["max"]:
        return f"{s['median']:,.0f}"
    return f"{s['median']:,.0f} ({s['min']:,.0f}-{s['max']:,.0f})"


def markdown(t):
    lines = ["| figure | pdmesh | llama.cpp CUDA | ratio | target met |", "|---|---|---|---|---|"]
    for r in t["rows"]:
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "-"
        lines.append(f"| {r['figure']} | {fmt(r['pdmesh'])} | {fmt(r['llama_cpp'])} ({r['llama_cpp_from']}) | {ratio} | {'yes' if r['met'] else 'no'} |")
    m = t["mesh"]
    if m:
        ttft = f"{m['ttft_p90_s'] * 1000:.0f} ms" if m["ttft_p90_s"] is not None else "-"
        lines += ["", f"Mesh at c=64: {m['mesh_c64_tokens_per_s']:,.0f} out tok/s, {m['share']:.2f}x the engine alone at "
                  f"batch 64 ({m['engine_b64_tokens_per_s']:,.0f}); TTFT p90 {ttft}. Targets 0.8x and 100 ms: "
                  f"{'met' if m['met'] else 'not met'}."]
    else:
        lines += ["", "Mesh: not run."]
    kv, nx = t.get("kv_vram") or {}, (t.get("kv_vram") or {}).get("nixl", {})
    if "gb_per_s" in nx:
        d2d = kv.get("d2d_copy", {}).get("gb_per_s", 0)
        lines += ["", f"KV GPU to GPU over NIXL: {nx['gb_per_s']:.1f} GB/s ({kv.get('bytes', 0) / 1e6:.1f} MB), "
                  f"{nx['vs_baseline']:.2f}x a device-to-device copy ({d2d:.1f} GB/s); bytes intact: {kv.get('bytes_match')}."]
    else:
        lines += ["", f"KV GPU to GPU over NIXL: not run ({nx.get('skipped') or kv.get('why', 'no kv-vram.json')})."]
    return "\n".join(lines) + "\n"


def main():
    out = sys.argv[1]
    t = table(out)
    json.dump(t, open(os.path.join(out, "side-by-side.json"), "w"), indent=1)
    md = markdown(t)
    open(os.path.join(out, "side-by-side.md"), "w").write(md)
    print(md)


if __name__ == "__main__":
    main()
