"""benchmarks/timeline_sublayers.py: sublayers grouped by launch sequence, medians relative to each
sublayer's first launch and the kind's period, rare kinds and the last sublayer dropped, gzipped
results read, a missing timeline refused."""

import gzip
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import timeline_sublayers as TS  # noqa: E402


def _acts():
    acts, t = [], 0.0
    for i in range(7):  # alternating kinds: A (mix, x, attn) and B (mix, route); ends with a mix (the head's)
        kind = ["_x", "_attn"] if i % 2 == 0 else ["route"]
        acts.append({"name": "_hc_mix_partial_kernel", "start_us": t, "dur_us": 3.0, "stream": 1})
        for j, name in enumerate(kind):
            acts.append({"name": name, "start_us": t + 2.0 + 4 * j + i * 0.1, "dur_us": 5.0 + i, "stream": 2})
        t += 20.0 if i % 2 == 0 else 30.0  # (the kinds' periods)
    acts.append({"name": "_hc_mix_partial_kernel", "start_us": t, "dur_us": 3.0, "stream": 1})
    return acts


def test_sublayers_by_launch_sequence():
    kinds = TS.sublayers(_acts())
    assert [k["count"] for k in kinds] == [4, 3]  # A: i = 0, 2, 4, 6; B: i = 1, 3, 5
    a = kinds[0]["launches"]
    assert [r["name"] for r in a] == ["_hc_mix_partial_kernel", "_x", "_attn"]
    # medians of i = 0, 2, 4, 6 (the two middle ones averaged): start 2 + 0.1 i, duration 5 + i
    assert a[1]["start_us"] == pytest.approx(2.3) and a[1]["dur_us"] == 8.0
    assert a[2]["end_us"] == pytest.approx(6.3 + 8.0)
    assert (kinds[0]["period_us"], kinds[1]["period_us"]) == (20.0, 30.0)
    assert TS.sublayers(_acts(), min_count=4) == kinds[:1]


def test_cli(tmp_path, capsys):
    p = tmp_path / "r.json"
    p.write_text(json.dumps({"timeline": {"1": {"activities": _acts()}}, "timelines": {"on": {"activities": _acts()}}}))
    assert TS.main([str(p)]) == 0 and "4 sublayers alike" in capsys.readouterr().out
    assert TS.main([str(p), "--arm", "on"]) == 0 and "3 sublayers alike" in capsys.readouterr().out
    assert TS.main([str(p), "--batch", "4"]) == 2
    assert "no timeline for batch 4 (it has: ['1'])" in capsys.readouterr().err
    z = tmp_path / "r.json.gz"
    z.write_bytes(gzip.compress(p.read_bytes()))
    assert TS.main([str(z), "--arm", "on"]) == 0
    assert "3 sublayers alike, period 30.0 us" in capsys.readouterr().out
