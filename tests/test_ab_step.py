"""benchmarks/ab_step.py's arms without a GPU: each arm sees its own settings and only its own (the
modules are put back after every arm, pin tables changed in place included), a failing arm loses
nothing, and bad --arm specs give one clear error."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import ab_step  # noqa: E402
from megastep.errors import UserError  # noqa: E402
from megastep.kernels import attention, moe_lut  # noqa: E402
from megastep.model import fast  # noqa: E402

QTAIL, SPREAD = fast.QNORM_TAIL_ROWS, moe_lut.SPREAD_ROWS  # the settings the arms below change, as pinned
ON = ("import megastep.model.fast as f, megastep.kernels.attention as a; f.QNORM_TAIL_ROWS += 2; "
      "a._PINNED_FEW_ROWS[(1, 2, 3)] = 'pin'; a.ARM_ONLY = 7; "
      "import megastep.kernels.moe_lut as m; m.SPREAD_ROWS += (99,)")


def test_what_the_measurement_fills_stays():
    """A cache the measurement fills (not the arm's statements) is left for the next arm."""
    def fill():
        fast._AB_CACHE = getattr(fast, "_AB_CACHE", 0) + 1
        return [{"batch": 1, "ms_p50": float(fast._AB_CACHE)}]

    try:
        table = ab_step.run_arms([("off", ""), ("on", ON)], 1, fill, log=lambda *_: None)
        assert [rec["results"][0]["ms_p50"] for rec in table[0]] == [1.0, 2.0] and fast._AB_CACHE == 2
    finally:
        del fast._AB_CACHE


def seen():
    """What a step launched now would read."""
    return [{"batch": 1, "ms_p50": 1.0 + fast.QNORM_TAIL_ROWS - QTAIL, "pin": attention._PINNED_FEW_ROWS.get((1, 2, 3)),
             "arm_only": getattr(attention, "ARM_ONLY", None), "spread": list(moe_lut.SPREAD_ROWS)}]


def test_arms_see_their_settings_and_are_undone():
    before = (fast.QNORM_TAIL_ROWS, dict(attention._PINNED_FEW_ROWS), moe_lut.SPREAD_ROWS)
    seen_so_far = []
    table = ab_step.run_arms([("off", ""), ("on", ON)], 2, seen, log=lambda *_: None,
                             progress=lambda t: seen_so_far.append([[rec["arm"] for rec in row] for row in t]))
    assert [[rec["arm"] for rec in row] for row in table] == [["off", "on"], ["off", "on"]]
    assert seen_so_far == [[["off"]], [["off", "on"]], [["off", "on"], ["off"]], [["off", "on"], ["off", "on"]]]
    for off, on in table:
        assert off["results"][0] == {"batch": 1, "ms_p50": 1.0, "pin": None, "arm_only": None, "spread": list(SPREAD)}
        assert on["results"][0] == {"batch": 1, "ms_p50": 3.0, "pin": "pin", "arm_only": 7,
                                    "spread": [*SPREAD, 99]}
        assert off["changed"] == []
        assert sorted(on["changed"]) == ["megastep.kernels.attention.ARM_ONLY",
                                         "megastep.kernels.attention._PINNED_FEW_ROWS",
                                         "megastep.kernels.moe_lut.SPREAD_ROWS", "megastep.model.fast.QNORM_TAIL_ROWS"]
    assert fast.QNORM_TAIL_ROWS is before[0] and attention._PINNED_FEW_ROWS == before[1]
    assert moe_lut.SPREAD_ROWS is before[2] and not hasattr(attention, "ARM_ONLY")
    text = ab_step.summarize([("off", ""), ("on", ON)], table)
    assert "1.000 / 1.000" in text and "3.000 / 3.000" in text and "+200.00%" in text


def test_a_failing_arm_records_its_error_and_the_others_run():
    bad = "import megastep.model.fast as f; f.QNORM_TAIL_ROWS += 1; raise RuntimeError('no kernel')"
    table = ab_step.run_arms([("off", ""), ("bad", bad)], 1, seen, log=lambda *_: None)
    off, failed = table[0]
    assert off["results"][0]["ms_p50"] == 1.0
    assert failed["error"] == "RuntimeError: no kernel" and "results" not in failed
    assert failed["changed"] == ["megastep.model.fast.QNORM_TAIL_ROWS"] and fast.QNORM_TAIL_ROWS == QTAIL
    assert "bad" in ab_step.summarize([("off", ""), ("bad", bad)], table).splitlines()[-1]


@pytest.mark.parametrize("specs, message", [
    ([], "at least one --arm"),
    (["off"], "NAME=STATEMENTS"),
    (["=x = 1"], "NAME=STATEMENTS"),
    (["a b=x = 1"], "NAME=STATEMENTS"),
    (["off=", "off=x = 1"], "given twice"),
    (["on=x = = 1"], "do not parse"),
])
def test_bad_arms_are_refused(specs, message):
    with pytest.raises(UserError, match=message):
        ab_step.parse_arms(specs)


def test_arms_parse():
    assert ab_step.parse_arms(["off=", "on=import x; x.Y = {'a': 1}"]) == [("off", ""),
                                                                        ("on", "import x; x.Y = {'a': 1}")]


def test_cli_refuses_what_it_cannot_do(capsys):
    assert ab_step.main(["--arm", "off=", "--trace"]) == 2
    assert "--trace is megastep bench's alone" in capsys.readouterr().err
    assert ab_step.main(["--arm", "off", "--layers", "2"]) == 2
    assert "NAME=STATEMENTS" in capsys.readouterr().err


def test_main_writes_each_arm_and_the_table(tmp_path, monkeypatch, capsys):
    """main's wiring without a GPU: bench.setup and bench.measure stand-ins, the JSON after every arm."""
    import json
    import types

    import torch

    from megastep import bench

    run = types.SimpleNamespace(cfg=types.SimpleNamespace(num_hidden_layers=2), bw=4400.0,
                                dec=types.SimpleNamespace(device="cuda:0"), runner=lambda args: "runner")
    writes = []

    def measure(r, runner, args, count_reads=True):
        assert r is run and runner == "runner" and args.iters == 3 and not count_reads  # times only
        if writes:  # the previous arm's JSON is on disk before this arm measures
            writes.append(len(json.load(open(tmp_path / "ab.json"))["rounds"][-1]))
        else:
            writes.append(0)
        return [{"batch": B, "ms_p50": 1.0 + fast.QNORM_TAIL_ROWS - QTAIL + B} for B in (1, 4)]

    def timeline(runner, B, context, block):  # one kernel whose length is the arm's QNORM_TAIL_ROWS change
        assert runner == "runner" and B == 4 and block == 1
        return [{"name": "k", "start_us": 0.0, "dur_us": 10.0 + fast.QNORM_TAIL_ROWS - QTAIL, "stream": 7}]

    monkeypatch.setattr(bench, "setup", lambda args: run)
    monkeypatch.setattr(bench, "measure", measure)
    monkeypatch.setattr(bench, "timeline_graph", timeline)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev: "Fake H200")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    argv = ["--layers", "2", "--batch", "1,4", "--iters", "3", "--rounds", "2", "--json", str(tmp_path / "ab.json"),
            "--arm", "off=", "--arm", "qt=import megastep.model.fast as f; f.QNORM_TAIL_ROWS += 1"]
    assert ab_step.main(argv + ["--timeline-batch", "4"]) == 0 and writes == [0, 1, 2, 1]
    out = json.load(open(tmp_path / "ab.json"))
    assert out["device"] == "Fake H200" and [a["name"] for a in out["arms"]] == ["off", "qt"]
    assert [[rec["results"][0]["ms_p50"] for rec in row] for row in out["rounds"]] == [[2.0, 3.0], [2.0, 3.0]]
    assert {k: v["summary"]["span_us"] for k, v in out["timelines"].items()} == {"off": 10.0, "qt": 11.0}
    assert fast.QNORM_TAIL_ROWS == QTAIL
    text = capsys.readouterr().out
    assert "2 rounds of 2 arms" in text and "    4 qt                   6.000 / 6.000" in text and "+20.00%" in text
    assert "arm qt, one graph replay of batch 4: 1 kernels over 0.011 ms" in text
    assert ab_step.main(argv + ["--timeline-batch", "2"]) == 2
    assert "--timeline-batch 2 must be one of --batch 1,4" in capsys.readouterr().err
