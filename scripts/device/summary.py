#!/usr/bin/env python3
"""Summary of a device check: reads the raw outputs of scripts/device-check.sh and writes
the result files (summary.md, summary.json, validate.json, bench.json, peers.json) into
the output folder, beside the env.txt, sanitize.txt and log.txt the script wrote itself.

Exit status: 0 when every step that ran passed and every validation record passed, 1
otherwise, 2 when the summary itself could not be written.
"""

import argparse
import csv
import io
import json
import os
import re
import sys


def load_json(path, default):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def steps(raw):
    out = []
    for line in read(os.path.join(raw, "steps.tsv")).splitlines():
        parts = line.split("\t")
        if len(parts) == 4:
            out.append({"step": parts[0], "status": parts[1], "seconds": int(parts[2] or 0), "note": parts[3]})
    return out


def validation(records):
    """Per op: passed / failed counts (anything not `pass` fails)."""
    by = {}
    for r in records if isinstance(records, list) else []:
        op = r.get("op", "?")
        d = by.setdefault(op, {"pass": 0, "fail": 0, "worst_err_over_tol": 0.0})
        if r.get("status") == "pass":
            d["pass"] += 1
        else:
            d["fail"] += 1
        w = r.get("worst_ratio")
        if isinstance(w, (int, float)):
            d["worst_err_over_tol"] = max(d["worst_err_over_tol"], w)
    return by


def sanitizer(raw, tool):
    text = read(os.path.join(raw, f"sanitize_{tool}.out")) + read(os.path.join(raw, f"sanitize_{tool}.err"))
    m = re.search(r"ERROR SUMMARY: (\d+) error", text)
    if m is None:
        m = re.search(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) error", text)
    return int(m.group(1)) if m else None


def ncu(raw):
    """kernel -> {metric: value} from the concatenated ncu CSV output."""
    text = read(os.path.join(raw, "ncu.csv"))
    rows = [ln for ln in text.splitlines() if ln.startswith('"')]
    out = {}
    header = None
    for ln in rows:
        rec = next(csv.reader(io.StringIO(ln)))
        if rec and rec[0] == "ID":
            header = rec
            continue
        if header is None or len(rec) != len(header):
            continue
        d = dict(zip(header, rec))
        name = d.get("Kernel Name", "?")
        try:
            val = float(d.get("Metric Value", "").replace(",", ""))
        except ValueError:
            continue
        out.setdefault(name, {})[d.get("Metric Name", "?")] = {"value": val, "unit": d.get("Metric Unit", "")}
    return out


def fmt_s(t):
    if t is None:
        return "-"
    if t < 1e-3:
        return f"{t * 1e6:.1f} us"
    return f"{t * 1e3:.2f} ms"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--raw", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", default="0")
    ap.add_argument("--elapsed", type=int, default=0)
    ap.add_argument("--budget", type=int, default=0)
    a = ap.parse_args()
    raw, out = a.raw, a.out
    st = steps(raw)
    vq = load_json(os.path.join(raw, "validate_quick.json"), [])
    vf = load_json(os.path.join(raw, "validate_full.json"), [])
    bench = load_json(os.path.join(raw, "bench.json"), {})
    peers = load_json(os.path.join(raw, "peers.json"), {"available": False, "reason": "peers step produced nothing", "peers": []})
    conf = read(os.path.join(raw, "conformance.txt"))
    conf_lines = [ln for ln in conf.splitlines() if ln.startswith("test result:")]
    san = {t: sanitizer(raw, t) for t in ("memcheck", "racecheck", "synccheck", "initcheck")}
    prof = ncu(raw)

    ceil = peers.get("ceilings") or {}
    peer_by = {(p["op"], p["config"]): p for p in peers.get("peers", [])}
    rows = []
    for r in bench.get("results", []) if isinstance(bench, dict) else []:
        p = peer_by.get((r["op"], r["config"]), {})
        row = {
            "op": r["op"],
            "config": r["config"],
            "time_s": r.get("time_s"),
            "bytes": r.get("bytes"),
            "flops": r.get("flops"),
            "fraction_of_own_roofline": r.get("fraction"),
            "peer_time_s": p.get("time_s"),
        }
        if row["time_s"] and row["peer_time_s"]:
            row["ours_over_peer"] = row["time_s"] / row["peer_time_s"]
        if ceil and row["time_s"]:
            need = max(
                (r.get("bytes") or 0) / ceil["copy_bytes_per_s"],
                (r.get("flops") or 0) / ceil["bf16_tc_flops_per_s"],
            )
            row["fraction_of_device_ceiling"] = need / row["time_s"]
        rows.append(row)

    ran = [s for s in st if s["status"] != "skipped"]
    failed_steps = [s["step"] for s in ran if s["status"] != "pass"]
    failed_records = sum(d["fail"] for d in validation(vq).values()) + sum(d["fail"] for d in validation(vf).values())
    ok = not failed_steps and failed_records == 0

    summary = {
        "dry_run": a.dry_run == "1",
        "elapsed_s": a.elapsed,
        "budget_s": a.budget,
        "ok": ok,
        "failed_steps": failed_steps,
        "steps": st,
        "validate": {"quick": validation(vq), "full": validation(vf), "conformance": conf_lines},
        "sanitizers": {t: {"errors": n} for t, n in san.items()},
        "bench": rows,
        "ceilings": ceil or None,
        "peers_available": peers.get("available", False),
        "peers_reason": peers.get("reason", ""),
        "ncu": prof,
        "roofline_of_bench": bench.get("roofline") if isinstance(bench, dict) else None,
    }

    md = []
    md.append(f"# Device check ({'dry run' if summary['dry_run'] else 'GPU'}): {'PASS' if ok else 'FAIL'}")
    md.append("")
    md.append(f"{a.elapsed} s of a {a.budget} s budget.")
    md.append("")
    md.append("| step | status | s | note |")
    md.append("|---|---|---|---|")
    for s in st:
        md.append(f"| {s['step']} | {s['status']} | {s['seconds']} | {s['note']} |")
    md.append("")
    md.append("## Validation")
    md.append("")
    md.append("| run | op | passed | failed | worst err/tol |")
    md.append("|---|---|---|---|---|")
    for name, recs in (("quick", vq), ("full", vf)):
        for op, d in sorted(validation(recs).items()):
            md.append(f"| {name} | {op} | {d['pass']} | {d['fail']} | {d['worst_err_over_tol']:.3f} |")
    for ln in conf_lines:
        md.append(f"\nconformance (cuda instance): {ln}")
    md.append("")
    md.append("## Sanitizers (tiny configs of every kernel)")
    md.append("")
    md.append("| tool | errors |")
    md.append("|---|---|")
    for t, n in san.items():
        md.append(f"| {t} | {'-' if n is None else n} |")
    md.append("")
    md.append("## Bench vs peers")
    md.append("")
    if ceil:
        md.append(
            f"Device ceilings measured in this run: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
            f"bf16 tensor cores {ceil['bf16_tc_flops_per_s'] / 1e12:.0f} TFLOP/s ({ceil.get('bf16_tc_note', '')})."
        )
    else:
        md.append(f"Peers and device ceilings: not measured ({summary['peers_reason']}).")
    md.append("")
    md.append("| op | config | ours | of own roofline | of device ceiling | peer (torch) | ours/peer |")
    md.append("|---|---|---|---|---|---|---|")
    for r in rows:
        frac = r.get("fraction_of_own_roofline")
        dev = r.get("fraction_of_device_ceiling")
        ratio = r.get("ours_over_peer")
        md.append(
            f"| {r['op']} | {r['config']} | {fmt_s(r['time_s'])} | "
            f"{'-' if frac is None else f'{frac:.2f}'} | {'-' if dev is None else f'{dev:.2f}'} | "
            f"{fmt_s(r['peer_time_s'])} | {'-' if ratio is None else f'{ratio:.2f}'} |"
        )
    md.append("")
    md.append("## ncu (one launch per kernel, --clock-control none)")
    md.append("")
    if prof:
        md.append("| kernel | time | DRAM read+write | DRAM % peak | achieved occupancy % | tensor pipe % |")
        md.append("|---|---|---|---|---|---|")
        for k, m in sorted(prof.items()):
            def v(name):
                return m.get(name, {}).get("value")
            t = v("gpu__time_duration.sum")
            unit = m.get("gpu__time_duration.sum", {}).get("unit", "")
            scale = {"nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3, "second": 1.0}.get(unit, 1e-9)
            rd, wr = v("dram__bytes_read.sum.per_second"), v("dram__bytes_write.sum.per_second")
            bw_unit = m.get("dram__bytes_read.sum.per_second", {}).get("unit", "")
            bw = None if rd is None or wr is None else rd + wr
            def pct(name):
                x = v(name)
                return "-" if x is None else f"{x:.1f}"
            md.append(
                f"| {k} | {fmt_s(None if t is None else t * scale)} | "
                f"{'-' if bw is None else f'{bw:.1f} {bw_unit}'} | {pct('dram__throughput.avg.pct_of_peak_sustained_elapsed')} | "
                f"{pct('sm__warps_active.avg.pct_of_peak_sustained_active')} | "
                f"{pct('sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active')} |"
            )
    else:
        md.append("No ncu data (skipped, missing, or counters not readable: see log.txt).")
    md.append("")

    try:
        with open(os.path.join(out, "summary.md"), "w") as f:
            f.write("\n".join(md))
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        with open(os.path.join(out, "validate.json"), "w") as f:
            json.dump({"quick": vq, "full": vf}, f)
        with open(os.path.join(out, "bench.json"), "w") as f:
            json.dump(bench, f, indent=2)
        with open(os.path.join(out, "peers.json"), "w") as f:
            json.dump(peers, f, indent=2)
    except OSError as e:
        print(f"cannot write the summary: {e}", file=sys.stderr)
        return 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
