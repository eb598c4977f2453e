"""Read an Nsight Compute source-page export (`ncu --import R --csv --page source --print-source
sass`, as h200_checks.sh small_ncu writes it, gzipped or not) and say where each launch's warps
spend their instructions, their stall samples and their shared-memory wavefronts.

    python benchmarks/kernels/ncu_source.py FILE [--kernel NAME] [--top 10] [--details DETAILS_CSV]

Per launch: warps, SASS instructions executed per warp (all instructions of the launch over its
warps: the serial work of one warp, which bounds a latency-bound kernel), the opcodes that make
them up, the stall reasons of the sampled warps and the hottest instructions. With --details (the
same report's details page) each launch also gets its duration. Small kernels get few samples:
read their instruction counts, not their sample shares.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip


def _open(path: str):
    return gzip.open(path, "rt") if path.endswith(".gz") else open(path)


def launches(path: str) -> list[dict]:
    """[{name, rows}] in report order; rows: dicts keyed by the page's column names."""
    out, hdr = [], None
    with _open(path) as f:
        for r in csv.reader(f):
            if not r:
                continue
            if r[0] == "Kernel Name":
                out.append({"name": r[1], "rows": []})
            elif r[0] == "Address":
                hdr = r
            elif out and hdr:
                out[-1]["rows"].append(dict(zip(hdr, r)))
    return out


def durations(path: str) -> list[tuple[str, str, float]]:
    """(kernel, grid, duration us) per launch of a details-page export, in report order."""
    seen = {}
    with _open(path) as f:
        for r in csv.DictReader(line for line in f if line.startswith('"')):
            if r["Metric Name"] == "Duration":
                scale = {"ns": 1e-3, "us": 1.0, "ms": 1e3}[r["Metric Unit"]]
                seen[r["ID"]] = (r["Kernel Name"], r["Grid Size"], float(r["Metric Value"].replace(",", "")) * scale)
    return [seen[k] for k in sorted(seen, key=int)]


def _int(v: str) -> int:
    return int(v.replace(",", "")) if v not in ("", "-") else 0


def summary(launch: dict, top: int) -> list[str]:
    rows = launch["rows"]
    warps = max(1, _int(rows[0]["Instructions Executed"]))  # the first instruction runs once per warp
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    ops, samples, stalls = collections.Counter(), collections.Counter(), collections.Counter()
    total = executed = 0
    for r in rows:
        text = r["Source"].strip()
        op = (text.split()[1] if text.startswith("@") else text.split()[0]).split(".")[0]
        n = _int(r["Instructions Executed"])
        ops[op] += n
        executed += n
        s = _int(r["Warp Stall Sampling (All Samples)"])
        samples[op] += s
        total += s
        for k in reasons:
            stalls[k[6:]] += _int(r[k])
    lines = [f"{launch['name']}: {warps} warps, {executed / warps:.0f} instructions per warp, {total} samples "
             f"({', '.join(f'{k} {v * 100 // max(sum(stalls.values()), 1)}%' for k, v in stalls.most_common(5))})",
             "  per warp: " + ", ".join(f"{op} {n / warps:.0f}" for op, n in ops.most_common(12))]
    # shared-memory wavefronts per warp by opcode, and how many of them were beyond the ideal (bank conflicts,
    # or for cp.async (LDGSTS) its lanes' global lines and 128 B of shared memory falling apart)
    smem = collections.defaultdict(lambda: [0, 0])
    for r in rows:
        if _int(r.get("L1 Wavefronts Shared", "")):
            text = r["Source"].strip()
            op = text.split()[1] if text.startswith("@") else text.split()[0]
            smem[op][0] += _int(r["L1 Wavefronts Shared"])
            smem[op][1] += _int(r["L1 Wavefronts Shared Excessive"])
    if smem:
        lines.append("  shared wavefronts per warp (excessive): " + ", ".join(
            f"{op} {w / warps:.0f} ({x / warps:.0f})" for op, (w, x) in sorted(smem.items(), key=lambda kv: -kv[1][0])))
    hot = sorted(rows, key=lambda r: -_int(r["Warp Stall Sampling (All Samples)"]))[:top]
    for r in hot:
        s = _int(r["Warp Stall Sampling (All Samples)"])
        if s == 0:
            break
        why = max(reasons, key=lambda k: _int(r[k]))[6:]
        lines.append(f"  {s * 100 / max(total, 1):5.1f}% {why:14} x{_int(r['Instructions Executed']):<6} "
                     f"{r['Source'].strip()[:80]}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("source")
    ap.add_argument("--kernel", help="only launches whose name contains this")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--details", help="the details-page export of the same report (durations)")
    a = ap.parse_args()
    times = durations(a.details) if a.details else None
    for i, launch in enumerate(launches(a.source)):
        if a.kernel and a.kernel not in launch["name"]:
            continue
        lines = summary(launch, a.top)
        if times:
            name, grid, us = times[i]
            assert name == launch["name"], (i, name, launch["name"])
            lines[0] = f"[{i}] {us:.2f} us grid {grid} " + lines[0]
        print("\n".join(lines))


if __name__ == "__main__":
    main()
