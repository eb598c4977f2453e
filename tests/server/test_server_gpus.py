"""`megastep serve --gpus 0,1` (skipped without two CUDA devices): one process per GPU, the routed
experts split; rank 0 serves HTTP. Its greedy completions equal a one-GPU fast server's, alone and
under concurrent load, and stopping the server ends every process it started."""

from __future__ import annotations

import concurrent.futures as cf
import time
from pathlib import Path

import openai
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                  reason="needs two CUDA devices")]

PROMPTS = ["The quick brown fox", "Once upon a time", "1, 2, 3,", "Rain in Spain"]


def _greedy(server, prompt):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    return c.completions.create(model=server.model, prompt=prompt, max_tokens=16, temperature=0).choices[0].text


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # field 4 of stat: the parent's pid
            kids.append(int(stat.parent.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_two_gpu_server_matches_one_gpu(start_server):
    common = ("--max-seqs", "4", "--capacity", "4096", "--chunk", "16")
    one = start_server(None, "--device", "cuda:0", "--engine", "fast", *common)
    try:
        want = [_greedy(one, p) for p in PROMPTS]
    finally:
        one.stop()
    two = start_server(None, "--gpus", "0,1", *common)
    try:
        assert "experts split over 2 GPUs" in two.output()
        alone = [_greedy(two, p) for p in PROMPTS]
        with cf.ThreadPoolExecutor(len(PROMPTS)) as ex:
            together = list(ex.map(lambda p: _greedy(two, p), PROMPTS))
        ranks = _children(two.proc.pid)
        assert len(ranks) >= 2, ranks  # the two rank processes (and multiprocessing's helper)
    finally:
        two.stop()
    assert alone == want and together == want
    deadline = time.time() + 20  # the processes it started (ranks, multiprocessing's tracker) wind down
    while [p for p in ranks if _alive(p)] and time.time() < deadline:
        time.sleep(0.2)
    assert not [p for p in ranks if _alive(p)]
