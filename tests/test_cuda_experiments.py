"""The CUDA C++ experiments under benchmarks/kernels, on the CPU: their sources still build with
nvcc into the entry points their wrappers name, with as many parameters as the wrappers'
signatures pass; the GEMV's shape rules keep within its kernel's limits; the timing probes of
launch_floor.py still find the lines they edit. Their numerics are checked on the GPU by their
scripts (gemv_variants.py: against the torch ref, run to run, a row alone against the batch), and
the GEMV's wgmma form by a marked test here as well.
The probes of route_probe.py (edited copies of the runtime's kernels/route_cuda.cu) still find their
lines and build. chain_probe.py (a chain of FP8 GEMVs in one persistent launch): its shapes, splits,
launch arguments and check on the CPU, its numerics and bits on the GPU (one test, marked). (The runtime's CUDA kernels themselves are checked beside their tests:
kernels/moe_lut.cu in tests/kernels/test_moe.py, kernels/route_cuda.cu in tests/kernels/test_route_cuda.py.)"""

import os
import re
import sys

import pytest
import torch

from megastep.kernels import cuda_module as cm

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks", "kernels"))

import gemv_fp8_cuda as GV  # noqa: E402
import launch_floor as LF  # noqa: E402

needs_nvcc = pytest.mark.skipif(cm.find_nvcc() is None, reason="nvcc not installed")


def _params(source: str, name: str) -> int:
    """The number of parameters of `extern "C"` kernel `name` in a .cu file's text."""
    head = source[source.index(name + "("):]
    return head[:head.index(")")].count(",") + 1


@needs_nvcc
def test_gemv_source_builds_with_every_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    cubin = cm.build_cubin(GV._SOURCE, GV._MODULE.arch)  # sm_90a: the wgmma form
    assert cubin[:4] == b"\x7fELF"
    for nt in (1, 2, 4, 8):
        for nb in (1, 2, 4, 8):
            assert f"gemv_fp8_nt{nt}_nb{nb}".encode() in cubin, (nt, nb)
            assert f"gemv_fp8_wg_nt{nt}_nb{nb}".encode() in cubin, (nt, nb)
            assert f"gemv_fp8_wgc_nt{nt}_nb{nb}".encode() in cubin, (nt, nb)
        for splits, nb in GV.CLUSTERS:
            for form in ("", "wgc_"):
                assert f"gemv_fp8_{form}cl{splits}_nt{nt}_nb{nb}".encode() in cubin, (form, splits, nt, nb)


def test_cluster_combine_has_entries_for_the_split_shapes():
    """The cluster entries cover the K splits the V4-Flash shapes take with 4 or 8 splits (wo_b, the
    shared expert's w1/w3 and w2), for the mma and the staged form, and no other form."""
    for N, K, gated in ((4096, 8192, False), (2048, 4096, True), (4096, 2048, False)):
        for M in (1, 16, 64):
            c = GV.pick_config(M, N, K, gated)
            s = GV.pick_config_wg(M, N, K, cp=True, gated=gated)
            assert GV.cluster_ok(GV.GemvConfig(c.nb, c.nt, c.r, cl=True), K), (N, K, M)
            assert GV.cluster_ok(GV.GemvConfig(s.nb, s.nt, s.r, True, True, True), K), (N, K, M)
            assert not GV.cluster_ok(GV.GemvConfig(s.nb, s.nt, s.r, True, False, True), K)  # no wg_ cluster entries
    assert not GV.cluster_ok(GV.GemvConfig(2, 1, 4, cl=True), 4096)  # the x group's 16 splits: none


@pytest.mark.parametrize("N,K,gated", [(1536, 4096, False), (40960, 1024, False), (4096, 8192, False),
                                       (2048, 4096, True), (4096, 2048, False), (128, 4096, False)])
def test_configs_keep_within_the_kernel(N, K, gated):
    nbs = set()
    for M in (1, 4, 16, 64):
        c = GV.pick_config(M, N, K, gated)
        nbs.add(c.nb)
        assert K % (128 * c.nb) == 0 and K // (128 * c.nb) <= GV.MAX_SPLIT
        assert 8 * c.nt >= min(M, 8) and c.r * (2 if gated else 1) <= 8
        assert GV._smem(c.nt, c.nb, c.r * (2 if gated else 1)) <= GV.SMEM_LIMIT
        if N % 64 == 0:  # the wgmma form: whole groups of 4 warps (gated: 4 pairs), the mma form's K split
            G = 2 if gated else 1
            w = GV.pick_config_wg(M, N, K, gated=gated)
            assert w.wg and w.r in ((4,) if gated else (4, 8)) and (N // 16) % w.r == 0 and w.nb == c.nb, (M, w)
            assert 8 * w.nt >= min(M, 8) and GV._smem(w.nt, w.nb, w.r * G, True) <= GV.SMEM_LIMIT
            s = GV.pick_config_wg(M, N, K, cp=True, gated=gated)  # the staged form: a bf16 slice beside the tiles
            assert s.cp and s.nb == c.nb and s.r == w.r and GV._smem(s.nt, s.nb, s.r * G, True, 2) <= GV.SMEM_LIMIT
            assert GV._smem(s.nt, s.nb, s.r * G, True, 4) <= 227 * 1024  # an fp32 x still fits an SM
    assert len(nbs) == 1  # the K split, hence every row's order of sums, depends on the shape only


def test_launch_floor_probes_find_their_lines():
    texts = [open(p).read() for p in LF.PROBE_FILES]
    for name, edits in LF.PROBES:
        for old, _ in edits:
            assert sum(old in t for t in texts) == 1, (name, old)


def test_signatures_match_the_kernels():
    gemv_src = open(GV._SOURCE).read()
    assert _params(gemv_src, "gemv_fp8_##FORM##nt##NT##_nb##NB") == len(GV._SIGNATURE)  # both forms' entries


@needs_nvcc
def test_route_probes_edit_once_and_build(tmp_path, monkeypatch):
    """route_probe.py's early exits and variants each edit route_cuda.cu exactly once (checked
    inside probe_kernels) and build for V4-Flash's expert count."""
    import route_probe as RP

    from megastep.kernels import route_cuda

    monkeypatch.setenv("HOME", str(tmp_path))
    kernels = RP.probe_kernels(str(tmp_path))
    assert sorted(kernels) == sorted(name for name, _, _ in RP.PROBES)
    for name, (_, exact) in kernels.items():
        assert exact == name.startswith(("shuffle", "fns"))  # the variants are checked against production
        path = str(tmp_path / name / "route_cuda.cu")
        assert cm.build_cubin(path, extra_flags=route_cuda.build_flags(RP.E))[:4] == b"\x7fELF"


# ---- chain_probe.{cu,py}: a chain of FP8 GEMVs in one persistent launch against one launch per layer


@needs_nvcc
def test_chain_probe_builds_every_entry_with_the_signature(tmp_path, monkeypatch):
    import chain_probe as CP

    monkeypatch.setenv("HOME", str(tmp_path))
    cubin = cm.build_cubin(CP.SOURCE)
    assert cubin[:4] == b"\x7fELF"
    with open(CP.SOURCE) as f:
        src = f.read()
    assert _params(src, "chain_##NAME##_w##W##_r##R##_kc##KC") == len(CP.SIGNATURE)
    macro = {"gemv": "CHAIN_ENTRY", "tri": "CHAIN_TRI_ENTRY", "xor": "CHAIN_XOR_ENTRY", "bulk": "CHAIN_BULK_ENTRY",
             "bxor": "CHAIN_BXOR_ENTRY"}
    for kind, shapes in CP.KINDS.items():
        for shape in shapes:
            assert CP.entry(*shape, kind).encode() in cubin, (kind, shape)
            assert f"{macro[kind]}({shape[0]}, {shape[1]}, {shape[2]})" in src, (kind, shape)
    listed = re.findall(r"^CHAIN_(?:TRI_|XOR_|BULK_|BXOR_)?ENTRY\(\d+, \d+, \d+\)$", src, re.MULTILINE)
    assert len(listed) == sum(len(v) for v in CP.KINDS.values())  # no entry the script does not run
    assert f"CHAIN_ENTRY_OF(tri, kTri, W, R, KC, {CP.TRI_XMAX})" in src
    assert f"CHAIN_ENTRY_OF(bulk, kBulk, W, R, KC, {CP.TRI_XMAX})" in src
    for name, value in (("kDesc", CP.DESC), ("kMaxLayers", CP.MAX_LAYERS), ("kMaxTiles", CP.MAX_TILES),
                        ("kTileCounters", CP.TILE_COUNTERS)):
        assert f"constexpr int {name} = {value};" in src, name


def test_chain_probe_shapes_fit_the_kernel():
    """Every entry fits one CTA per SM (more than half of the shared memory: never two); the chains fit
    the entries the script runs them with, "tri" in linear_fp8's own splits; bad chains are refused."""
    import chain_probe as CP

    for kind, shapes in CP.KINDS.items():
        for shape in shapes:
            assert CP.SMEM_LIMIT // 2 < CP.smem_bytes(*shape, kind) <= CP.SMEM_LIMIT, (kind, shape)
            assert shape[0] * 32 * 128 <= 65536  # registers: every thread may use 128 at one CTA per SM
    for name in ("hca4", "hca", "wo"):  # every entry runs the timed chains (KC 1024: not hca4's x group)
        for kind, shapes in CP.KINDS.items():
            for shape in shapes:
                if name == "hca4" and shape[2] == 1024:
                    assert not CP.fits(CP.CHAINS[name], shape[2], kind)
                else:
                    CP.check_chain(CP.CHAINS[name], shape[2], kind)
    small = CP.CHAINS["small"]
    assert CP.splits(small, 256, "tri") == (4, 2, 16) and CP.splits(small, 256, "gemv") == (4, 2, 16)
    assert CP.fits(small, 256, "tri") and not CP.fits(small, 512, "tri") and CP.fits(small, 512, "gemv")
    assert CP.splits(CP.CHAINS["hca"], 512, "tri") == (1, 4, 8)  # the step's: K / 1024 per split
    assert CP.splits(CP.CHAINS["hca4"], 512, "tri") == (8, 1, 4, 8)
    assert CP.chain_bytes(CP.CHAINS["hca"]) == 3 * 32768 * 1024 + 3 * 256 * 8
    assert CP.gaps_us(CP.CHAINS["hca4"], True) == [0.0, 2.7, 13.8, 0.0] and not any(CP.gaps_us(small, False))
    for bad, match in ((((512, 512, 1, 0), (512, 1024, 1, 0)), "reads 1 x 1024"), (((520, 512, 1, 0),), "multiple of 16"),
                       (((512, 384, 1, 0),), "multiple of KC"), (((256, 256, 1, 0),) * 5, "1..4 layers"),
                       (((512, 256, 3, 0),), "multiple of 16"), (((512, 256, 1, 0),), "multiple of KC 512")):
        with pytest.raises(ValueError, match=match):
            CP.check_chain(bad, 512 if "512" in match else 256)
    CP.check_chain(((512, 512, 1, 0), (256, 256, 1, 0)), 256)  # a layer may read the first part of y


def test_chain_probe_check_can_fail():
    """The probe's check passes the exact ref's outputs and fails when one element of a grouped
    layer is off by a tenth of the layer's largest output (so the GPU check below has power)."""
    import chain_probe as CP

    from megastep.kernels import linear_fp8 as LIN

    chain = CP.Chain(((384, 256, 1, 0), (512, 128, 2, 0)), torch.Generator().manual_seed(0), device="cpu")
    for i, (ly, y) in enumerate(zip(chain.layers, chain.ys)):  # layer 1 reads the first 256 of 384
        y.copy_(LIN.linear_fp8_ref(chain.x(i), ly.w, ly.ws, out_dtype=torch.float32, groups=ly.G)[0])
    assert chain.x(1).shape == (1, 256) and chain.x(1).data_ptr() == chain.ys[0].data_ptr()
    assert chain.check() == 0.0
    y = chain.ys[1]
    y[300] += 0.1 * y.abs().max().item()
    with pytest.raises(AssertionError, match="layer 1"):
        chain.check()


def test_chain_probe_launches_one_or_per_layer():
    """"chain" is one launch over every layer's descriptor; "sep" / "sep_pdl" one launch per layer, each
    pointing at its own descriptor and counters, PDL only in "sep_pdl"; one CTA per SM, W warps; the
    descriptors carry each kind's splits (linear_fp8's for "tri") and the stages' gaps in ns, or none."""
    import chain_probe as CP

    calls = []

    class Kernel:
        def launch(self, grid, block, smem, stream, *args, pdl=False):
            calls.append((grid, block, smem, args, pdl))

    class Module:
        def kernel(self, name, signature):
            assert name in ("chain_gemv_w8_r6_kc256", "chain_tri_w16_r2_kc256", "chain_bulk_w8_r6_kc256")
            assert signature == CP.SIGNATURE
            return Kernel()

    chain = CP.Chain(CP.CHAINS["small"], torch.Generator().manual_seed(0), device="cpu")
    chain.launch(Module(), (8, 6, 256), "chain", True, sms=132)
    (grid, block, smem, args, pdl), = calls
    assert grid == (132, 1, 1) and block == (256, 1, 1) and smem == CP.smem_bytes(8, 6, 256) and not pdl
    assert args[0] is chain.desc(256, "gemv", True) and args[1] == 3
    assert args[2].data_ptr() == chain.counters[0].data_ptr()
    assert args[4] == 0 and len(args) == len(CP.SIGNATURE)
    desc = chain.desc(256, "gemv", True).view(3, CP.DESC)
    assert desc[1, 2].item() == chain.ys[0].data_ptr() and desc[2, 2].item() == chain.ys[1].data_ptr()
    assert desc[0, 2].item() == chain.x0.data_ptr() and desc[1, 5:].tolist() == [8192, 512, 8, 2, 2000]
    assert desc[:, 9].tolist() == [0, 2000, 0] and chain.desc(256, "gemv", False)[9::CP.DESC].tolist() == [0, 0, 0]
    for mode in ("sep", "sep_pdl"):
        calls.clear()
        chain.launch(Module(), (8, 6, 256), mode, False, sms=132)
        assert len(calls) == 3
        for i, (_, _, _, args, pdl) in enumerate(calls):
            assert args[0] == chain.desc(256, "gemv", False).data_ptr() + 8 * CP.DESC * i and args[1] == 1
            assert args[2].data_ptr() == chain.counters[i].data_ptr()
            assert pdl == (mode == "sep_pdl") and args[4] == int(pdl)
    calls.clear()
    chain.launch(Module(), (16, 2, 256), "chain", sms=132, kind="tri")
    (_, _, smem, args, _), = calls
    assert smem == CP.smem_bytes(16, 2, 256, "tri") == 16 * 2 * 16 * 256 + 16 * (2 * CP.TRI_XMAX + 64)
    assert args[0].view(3, CP.DESC)[:, 8].tolist() == list(CP.splits(CP.CHAINS["small"], 256, "tri"))
    assert len(chain._descs) == 2  # once per split set and gaps on / off (gemv and tri split "small" alike)
    calls.clear()
    chain.launch(Module(), (8, 6, 256), "chain", sms=132, kind="bulk")  # rows KC + 16 apart, 8-byte mbarriers
    (_, _, smem, args, _), = calls
    assert smem == CP.smem_bytes(8, 6, 256, "bulk") == 8 * 6 * 16 * 272 + 8 * (2 * CP.TRI_XMAX + 64) + 8 * 8 * 6
    assert args[0].view(3, CP.DESC)[:, 8].tolist() == list(CP.splits(CP.CHAINS["small"], 256, "tri"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_chain_probe_matches_the_ref_and_its_own_bits():
    """The small chain (a grouped layer in the middle) in every entry that takes it: each layer within
    1e-5 of the |products| sum of linear_fp8_ref ("tri": linear_fp8's bits), the per-layer launches
    (plain and PDL) and the one persistent launch (twice) the same bits, no warp giving up on a
    layer's input."""
    import chain_probe as CP

    lines = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    module, chain = cm.CudaModule(CP.SOURCE), CP.Chain(CP.CHAINS["small"], gen)
    entries = [(k, s) for k in ("gemv", "tri", "bulk") for s in CP.KINDS[k] if CP.fits(CP.CHAINS["small"], s[2], k)]
    assert len(entries) == 9
    for kind, shape in entries:
        CP.check_shape(module, chain, shape, lines.append, kind)  # raises on any failure
    assert sum("same bits" in line for line in lines) == len(entries)
    assert sum("linear_fp8's bits" in line for line in lines) == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cp", [False, True], ids=["wg", "staged"])
@pytest.mark.parametrize("N,K,epilogue", [(1536, 4096, "plain"), (4096, 8192, "residual"), (4096, 2048, "residual"),
                                          (2048, 4096, "gated")])
def test_gpu_gemv_wgmma_form_matches_the_ref_and_its_rows_alone(N, K, epilogue, cp):
    """The wgmma form of the CUDA GEMV (built 2026-12-07 without a device) and its staged form (x's
    slice copied by cp.async, 2026-12-08): within one bf16 step of linear_fp8_ref at 1, 3, 16 and 64 rows
    (two row groups at 64), the same bits run to run, each row alone (its own 1-row configuration) the
    row's bits in the batch; the staged form with x's codes too, against the wgmma form's bits. Gated
    (the shared expert's w1/w3, 2026-12-08): against linear_fp8_swiglu_ref and the mma form's bits."""
    from megastep.checkpoint import formats
    import bench_kernels as BK

    from megastep.kernels import linear_fp8 as LIN

    g = torch.Generator(device="cuda").manual_seed(3)
    gated, limit = epilogue == "gated", 10.0
    w, s = BK.fp8_weight(2 * N if gated else N, K, g, device="cuda")
    for M in (1, 3, 16, 64):
        # gated: x / 16 puts w1's and w3's outputs around the clamp's limit, on both sides of it
        x = (torch.randn(M, K, device="cuda", generator=g) / (16 if gated else 1)).bfloat16()
        res = torch.randn(M, N, device="cuda", generator=g) if epilogue == "residual" else None
        cfg = GV.pick_config_wg(M, N, K, cp, gated)

        def call(x=x, res=res, cfg=cfg, xc=None):
            out = torch.empty(x.shape[0], N, dtype=torch.bfloat16, device="cuda")
            return GV.gemv_fp8(x, w, s, out, gated=gated, limit=limit if gated else 0.0, residual=res, config=cfg,
                               x_codes=xc)

        y = call()
        ref = None if gated else LIN.linear_fp8_ref(x, w, s, residual=res)
        ok, msg = BK.check_swiglu(y, x, w, s, limit) if gated else BK.check_linear(y, ref)
        assert ok, (M, cfg, msg)
        assert torch.equal(y.view(torch.int16), call().view(torch.int16)), (M, cfg)
        if cp:  # the unstaged form's bits, from x and from x's codes and scales (staged by their own copies)
            wg = GV.pick_config_wg(M, N, K, gated=gated)
            assert torch.equal(y.view(torch.int16), call(cfg=wg).view(torch.int16)), M
            codes = formats.fp8_act_quant(x.float(), 128)
            assert torch.equal(call(xc=codes).view(torch.int16), call(cfg=wg, xc=codes).view(torch.int16)), M
        if gated:  # the same sums as the mma form's warp pairs
            assert torch.equal(y.view(torch.int16), call(cfg=GV.pick_config(M, N, K, True)).view(torch.int16)), M
        one = GV.pick_config_wg(1, N, K, cp, gated)
        for i in range(M):
            alone = call(x=x[i:i + 1], res=None if res is None else res[i:i + 1], cfg=one)
            assert torch.equal(alone.view(torch.int16), y[i:i + 1].view(torch.int16)), (M, i)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("N,K,gated", [(4096, 8192, False), (2048, 4096, True), (4096, 2048, False)])
def test_gpu_gemv_cluster_combine_gives_the_global_combines_bits(N, K, gated):
    """The K splits summed through DSMEM in a cluster (2026-12-08): the bits of the global combine, for the
    mma and the staged form, at 1, 3, 16 and 64 rows, twice."""
    import dataclasses

    import bench_kernels as BK

    g = torch.Generator(device="cuda").manual_seed(5)
    w, s = BK.fp8_weight(2 * N if gated else N, K, g, device="cuda")
    for M in (1, 3, 16, 64):
        x = (torch.randn(M, K, device="cuda", generator=g) / (16 if gated else 1)).bfloat16()
        for cfg in (GV.pick_config(M, N, K, gated), GV.pick_config_wg(M, N, K, cp=True, gated=gated)):
            def call(c):
                out = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
                return GV.gemv_fp8(x, w, s, out, gated=gated, limit=10.0 if gated else 0.0, config=c).view(torch.int16)

            y = call(cfg)
            for _ in range(2):
                assert torch.equal(call(dataclasses.replace(cfg, cl=True)), y), (M, cfg)
