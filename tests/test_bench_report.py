"""`megastep bench`'s printed report from a results dict (what run_bench returns): the table, the
cold-path line (the CPU share only where it is used) and the per-stage kernel table."""

from megastep.bench import print_report


def _out(cold_path):
    nb = {"total": 8.0e9}
    return {
        "device": "GPU", "gpus": 1, "preset": "v4-flash", "layers": 2, "context": 4096, "stream_read_GBps": 4000.0,
        "routing": "skewed", "cold_path": cold_path, "cpu_share": 0.73, "cpu_read_GBps": 140.0, "host_read_GBps": 51.0,
        "sidecar": "poll",
        "placement": {"hbm_budget_GB": 125.0, "n_hot": 10, "n_cold": 2, "cold_slot_fraction": 0.016},
        "results": [{"batch": 1, "ms_p50": 4.0, "ms_p90": 4.1, "ms_p99": 4.2, "tokens_per_s": 250.0, "bytes": nb,
                     "roofline_ms": 2.0, "pct_of_roofline": 50.0}],
        "peer": None,
        "timeline": {"1": {"summary": {"activities": 5, "span_us": 3900.0, "sum_us": 4100.0, "busy_us": 3700.0,
                                       "idle_us": 200.0, "largest_gaps": [{"us": 12.5, "after": "_linear_fp8_kernel"}]},
                           "activities": []}},
        "trace": {"1": {"by_stage_us": {"attention": 30.0, "mhc_pre": 10.0}, "eager_wall_ms": 9.0,
                        "kernels": {"attention": {"device_us": 60.0, "kernels": 2, "names": {"_attn": [60.0, 2]}},
                                    "mhc_pre": {"device_us": 20.0, "kernels": 4, "names": {}}}}},
    }


def test_report_lines(capsys):
    print_report(_out("hybrid"))
    text = capsys.readouterr().out
    assert "cold experts: hybrid (CPU share 0.73), sidecar poll, CPU read 140.0 GB/s" in text
    row = next(line for line in text.splitlines() if line.split()[:2] == ["1", "4.000"])
    assert row.split()[-2:] == ["2.000", "86.00"]  # ms per layer, x43
    # kernels: 80 us of device time in 6 launches against a 4 ms replay
    assert "0.08 ms in 6 launches; graph replay 4.00 ms -> 3.92 ms between kernels" in text
    assert "attention           30.0 us/layer    1.0 launches/layer  _attn 30.0" in text
    assert ("timeline of one graph replay, batch 1: 5 kernels over 3.900 ms, 4.100 ms of kernel time, covered "
            "3.700 ms, idle 0.200 ms; largest idle stretches (us, after): 12.5 _linear_fp8_kernel") in text


def test_sidecar_line(capsys):
    """Recipes B and hybrid: what the CPU did per step, under the table (a result without it: no line)."""
    out = _out("cpu")
    out["results"][0]["sidecar_cpu"] = {
        "steps": 40, "jobs_per_step": 43, "busy_jobs_per_step": 3.5, "experts_per_step": 4.1,
        "busy_ms_per_step": 0.82, "busy_job_us_mean": 234.3, "busy_job_us_max": 910.0, "idle_job_us_mean": 3.25,
        "cpu_GBps": 66.8}
    print_report(out)
    text = capsys.readouterr().out
    assert ("CPU sidecar, batch 1: 3.50 of 43 jobs a step read 4.10 experts in 0.820 ms of CPU time (a busy job "
            "234 us mean, 910 max, 66.8 GB/s of expert bytes); the other jobs 3.2 us each; 40 steps") in text
    out["results"][0]["sidecar_cpu"] = None
    print_report(out)
    assert "CPU sidecar" not in capsys.readouterr().out


def test_cpu_share_only_for_hybrid(capsys):
    out = _out("cpu")
    del out["sidecar"]  # a result from before the field
    print_report(out)
    text = capsys.readouterr().out
    assert "cold experts: cpu, CPU read 140.0 GB/s; host bw of the roofline: the CPU's" in text
    assert "CPU share" not in text and "sidecar" not in text


def test_lut_experts_on_a_preset_they_cannot_run_is_one_clear_error(monkeypatch):
    """`--moe-mode lut` where the CUDA experts kernels cannot run (the small preset: I = 256) stops
    with one message before any weight is made, not a traceback from the decoder."""
    import argparse

    import pytest
    import torch

    from megastep import bench
    from megastep.errors import UserError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the check runs before any device work
    p = argparse.ArgumentParser()
    bench.add_bench_arguments(p)
    args = p.parse_args(["--preset", "small", "--batch", "1", "--moe-mode", "lut"])
    with pytest.raises(UserError, match="--moe-mode lut needs"):
        bench.run_bench(args)


def test_reads_line(capsys):
    """The routed experts the measured rows read, next to the expectation, and the roofline with them."""
    out = _out("gpu")
    out["cpu_read_GBps"] = None  # recipe A: no CPU path
    out["results"][0]["bytes"] = {"total": 8.0e9, "hot_experts_per_step": 254.0, "cold_experts_per_step": 4.09}
    out["results"][0]["reads"] = {"steps": 3, "hot_per_step": [255, 255, 256], "cold_per_step": [3, 3, 2],
                                  "roofline_ms": 1.8}
    print_report(out)
    text = capsys.readouterr().out
    assert ("batch 1: routed experts the rows read in 3 eager steps: 255/255/256 in HBM, 3/3/2 in host memory "
            "(expected 254.0 / 4.09); roofline with these reads 1.800 ms (45.0%)") in text
    assert "passes" not in text  # (results before the pass count)
    out["results"][0]["reads"].update(passes_per_step=[300, 310, 314], most_pairs=[5, 6, 4])
    print_report(out)
    assert ("  the experts kernels' passes over those experts' weights (2 pairs a pass): 300/310/314, 1.194 per "
            "expert read; the most pairs on one expert 5/6/4") in capsys.readouterr().out
    out["results"][0]["reads"].update(down_passes_per_step=[260, 262, 264], down_pairs_per_pass=4)
    print_report(out)
    assert ("(2 pairs a pass): 300/310/314, 1.194 per expert read; down's (4 pairs a pass): 260/262/264, 1.016 per "
            "expert read; the most pairs on one expert 5/6/4") in capsys.readouterr().out
    out["results"][0]["reads"].update(pairs_per_pass=8)  # (moe_lut.GATE_UP_GM's passes)
    print_report(out)
    assert "(8 pairs a pass): 300/310/314" in capsys.readouterr().out
    out["results"][0]["reads"] = None
    print_report(out)
    assert "eager steps" not in capsys.readouterr().out


def test_budget_and_memory_lines(capsys):
    """The placement line says when the budget was sized by `auto`, and the device's memory follows it
    (older results without it print no memory line)."""
    out = _out("gpu")
    out["cpu_read_GBps"] = None
    out["placement"].update(hbm_budget_GB=138.25, auto=True, hbm_bytes=138.2e9)
    out["device_memory"] = {"total_GB": 150.8, "free_at_start_GB": 149.9, "free_GB": 3.1, "peak_allocated_GB": 142.6,
                            "peak_reserved_GB": 146.0}
    print_report(out)
    text = capsys.readouterr().out
    assert "HBM budget 138.25 GB (auto): 10 experts in HBM, 2 in host memory" in text
    assert ("device memory (GB): 150.8, free at start 149.9, weights in HBM 138.2; peak allocated 142.6, peak "
            "reserved 146.0; free at the end 3.1") in text
    del out["device_memory"]
    out["placement"]["auto"] = False
    print_report(out)
    text = capsys.readouterr().out
    assert "device memory" not in text and "HBM budget 138.25 GB: " in text
