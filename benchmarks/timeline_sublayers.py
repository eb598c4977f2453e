"""A sublayer's launches at one row, medians over the layers: when each starts and ends after the
sublayer's first launch (its mHC mixes), from a `megastep bench --timeline` (or `ab_step.py
--timeline-batch`) JSON.

    python benchmarks/timeline_sublayers.py RESULT.json[.gz] [--batch 1] [--arm NAME]

A sublayer runs from one mHC mixes launch to the next; sublayers with the same launch sequence are
alike (an attention sublayer of each kind, the MoE sublayer) and their launches are listed in start
order with the median start and end (us) and the median duration, under the kind's median period
(its first launch to the next sublayer's). Why: a layer's critical chain and where HBM idles are
read from these (docs/PERFORMANCE.md, 2026-12-04 late night, item 1), which `megastep bench`'s layer
anatomy (charges per layer period) does not show.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from ab_step import read_result_or_say

FIRST = "_hc_mix_partial"  # every sublayer's first launch


def sublayers(acts: list[dict], first: str = FIRST, min_count: int = 3) -> list[dict]:
    """Group the sublayers (first launch to the next first launch, the last one dropped: it may hold
    the head) by launch sequence; for each kind seen at least min_count times: its launches' median
    start, end and duration relative to the sublayer's start, and the median period (to the next
    sublayer's first launch), most common kind first."""
    starts = [i for i, a in enumerate(acts) if a["name"].startswith(first)]
    kinds: dict[tuple[str, ...], list[tuple[list[dict], float]]] = {}  # (launches, period) of each
    for i, j in zip(starts, starts[1:]):
        seq = acts[i:j]
        kinds.setdefault(tuple(a["name"] for a in seq), []).append((seq, acts[j]["start_us"] - acts[i]["start_us"]))
    out = []
    for names, found in sorted(kinds.items(), key=lambda kv: -len(kv[1])):
        if len(found) < min_count:
            continue
        seqs = [seq for seq, _ in found]
        rows = []
        for n, name in enumerate(names):
            rel = [(s[n]["start_us"] - s[0]["start_us"], s[n]["dur_us"]) for s in seqs]
            rows.append({"name": name, "start_us": statistics.median(r[0] for r in rel),
                         "end_us": statistics.median(r[0] + r[1] for r in rel),
                         "dur_us": statistics.median(r[1] for r in rel), "stream": seqs[0][n]["stream"]})
        out.append({"count": len(seqs), "period_us": statistics.median(p for _, p in found), "launches": rows})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json")
    ap.add_argument("--batch", default="1", help="the timeline's batch (bench --timeline)")
    ap.add_argument("--arm", default=None, help="ab_step.py's arm whose timeline to read")
    args = ap.parse_args(argv)
    res = read_result_or_say(args.json, "timeline_sublayers")
    if res is None:
        return 2
    try:
        tl = res["timelines"][args.arm] if args.arm else res["timeline"][args.batch]
    except KeyError:
        have = sorted(res.get("timelines", {})) if args.arm else sorted(res.get("timeline", {}))
        print(f"error: {args.json} has no timeline for {args.arm or 'batch ' + args.batch} (it has: {have})",
              file=sys.stderr)
        return 2
    for kind in sublayers(tl["activities"]):
        print(f"\n{kind['count']} sublayers alike, period {kind['period_us']:.1f} us; us after the mHC mixes start "
              "(medians):")
        print(f"{'start':>7} {'end':>7} {'dur':>6}  stream  launch")
        for r in kind["launches"]:
            print(f"{r['start_us']:7.1f} {r['end_us']:7.1f} {r['dur_us']:6.1f}  {r['stream']!s:>6}  {r['name'][:60]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
