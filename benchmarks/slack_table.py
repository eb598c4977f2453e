"""The slack of each delayed stage, from an ab_step.py JSON of `h200_checks.sh slack` (arms named
STAGE_US: runtime/trace.set_delays of US microseconds at the first entry of STAGE in each layer).

    python benchmarks/slack_table.py ab-step-slack.json[.gz]

For each stage and batch: the median p50 over the rounds at the smaller and the larger delay, and
the share of the added delay the step could not hide,

    share = (p50(larger) - p50(smaller)) / ((larger - smaller) us x the layers with the stage)

1: the step waited for the stage's start in every layer (its first launch is on the critical path);
0: the stage had at least that much slack. Two delays, not a delay against none, because the spin
also removes the PDL overlap between the launches around it. The layers with a stage come from the
preset's layer kinds: "compressor" in the compressed (CSA and HCA) layers, "indexer" in the CSA
layers, every other stage in every layer. Which launch a stage's first entry is, where it differs by
layer kind: "attn_proj" is the side stream's bf16 projections (compressors, indexer) in compressed
layers and the x group in sliding ones; "indexer" is its compressor (model/fast.py's order).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys

from ab_step import read_result_or_say

ARM = re.compile(r"^(?P<stage>[a-z_]+)_(?P<us>\d+(?:\.\d+)?)$")


def layers_with(stage: str, kinds: list[str]) -> int:
    """How many of the layers (their kinds: sliding / csa / hca) enter `stage`."""
    if stage == "compressor":
        return sum(k != "sliding" for k in kinds)
    if stage == "indexer":
        return sum(k == "csa" for k in kinds)
    return len(kinds)


def medians(data: dict) -> dict[tuple[str, int], float]:
    """(arm, batch) -> median over the rounds of the p50 ms (arms that failed are left out)."""
    got: dict[tuple[str, int], list[float]] = {}
    for row in data["rounds"]:
        for rec in row:
            for x in rec.get("results", []):
                got.setdefault((rec["arm"], x["batch"]), []).append(x["ms_p50"])
    return {k: statistics.median(v) for k, v in got.items()}


def shares(data: dict, kinds: list[str]) -> list[dict]:
    """One row per (stage, batch) with at least two delays measured: the two extreme delays."""
    med = medians(data)
    delays: dict[str, list[float]] = {}
    for arm in data["arms"]:
        m = ARM.match(arm["name"])
        if m:
            delays.setdefault(m["stage"], []).append(float(m["us"]))
    rows = []
    for stage, us in delays.items():
        lo, hi = min(us), max(us)
        if lo == hi:
            continue
        n = layers_with(stage, kinds)
        for B in sorted({b for (_, b) in med}):
            a, b = med.get((f"{stage}_{lo:g}", B)), med.get((f"{stage}_{hi:g}", B))
            if a is None or b is None:
                continue
            rows.append({"stage": stage, "batch": B, "layers": n, "lo_us": lo, "hi_us": hi, "ms_lo": a, "ms_hi": b,
                         "share": (b - a) * 1e3 / ((hi - lo) * n)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", help="ab_step.py's --json (gzipped or not)")
    args = ap.parse_args(argv)
    data = read_result_or_say(args.json, "slack_table")
    if data is None:
        return 2
    from megastep.checkpoint.synthetic import preset

    cfg = preset(data["preset"], layers=data["layers"])
    kinds = [cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)]
    rows = shares(data, kinds)
    if not rows:
        print("slack_table: no stage with two delays measured (arms named STAGE_US)", file=sys.stderr)
        return 2
    print(f"{data.get('device', '?')}, {data['preset']} {data['layers']} layers; share of a delay the step could not hide")
    print("| stage | rows | layers with it | p50 ms at the smaller / larger delay | share |")
    print("| --- | ---: | ---: | --- | ---: |")
    for r in sorted(rows, key=lambda r: (r["batch"], -r["share"])):
        print(f"| {r['stage']} | {r['batch']} | {r['layers']} | {r['ms_lo']:.3f} / {r['ms_hi']:.3f} "
              f"({r['lo_us']:g} / {r['hi_us']:g} us) | {r['share']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
