"""benchmarks/slack_table.py: the share of a stage's added delay that the step could not hide, from
ab_step.py's JSON of `h200_checks.sh slack`; the layers with each stage from the preset's kinds."""

import gzip
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import slack_table as ST  # noqa: E402


def _data(p50):
    """ab_step's JSON: arms in order, 2 rounds, each arm's p50 per batch from p50[arm][batch] (+ the round's noise)."""
    arms = [{"name": n, "statements": ""} for n in p50]
    rounds = [[{"arm": n, "round": r, "changed": [], "results": [{"batch": b, "ms_p50": v + 0.001 * r}
                                                                  for b, v in p50[n].items()]}
               for n in p50] for r in range(2)]
    return {"device": "H200", "preset": "v4-flash", "layers": 30, "arms": arms, "rounds": rounds}


def test_shares_divide_the_growth_by_the_delay_and_the_layers_with_the_stage():
    kinds = ["sliding"] * 2 + ["csa", "hca"] * 14  # v4-flash's first 30 layers
    assert (ST.layers_with("router", kinds), ST.layers_with("compressor", kinds), ST.layers_with("indexer", kinds)) \
        == (30, 28, 14)
    d = _data({"off": {1: 4.400, 4: 7.500},
               "router_5": {1: 4.500, 4: 7.600}, "router_10": {1: 4.650, 4: 7.675},  # 150 / 75 us more for 150 added
               "indexer_5": {1: 4.450}, "indexer_10": {1: 4.485},  # 35 us more for 14 x 5 added
               "attention_5": {1: 4.5}})  # one delay only: no row
    rows = {(r["stage"], r["batch"]): r for r in ST.shares(d, kinds)}
    assert set(rows) == {("router", 1), ("router", 4), ("indexer", 1)}
    assert abs(rows["router", 1]["share"] - 1.0) < 1e-9 and abs(rows["router", 4]["share"] - 0.5) < 1e-9
    assert abs(rows["indexer", 1]["share"] - 0.5) < 1e-9 and rows["indexer", 1]["layers"] == 14


def test_main_prints_the_table_and_refuses_what_it_cannot_read(tmp_path, capsys):
    path = tmp_path / "slack.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_data({"off": {1: 4.4}, "router_5": {1: 4.5}, "router_10": {1: 4.65}}), f)
    assert ST.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "| router | 1 | 30 | 4.501 / 4.651 (5 / 10 us) | 1.00 |" in out
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert ST.main([str(bad)]) == 2 and "cannot read" in capsys.readouterr().err
    one = tmp_path / "one.json"
    one.write_text(json.dumps(_data({"off": {1: 4.4}, "router_5": {1: 4.5}})))
    assert ST.main([str(one)]) == 2 and "no stage with two delays" in capsys.readouterr().err
