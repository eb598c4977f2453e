"""The fast decoder's MoE sublayer: where each layer's routed experts live (HBM, page-locked host
memory, or the CPU sidecar), the router, the shared expert beside the routed experts, and their
combine in a fixed order. `FastDecoder` takes these methods as a mixin: they read its state (cfg,
layers, streams, trace, the peer combine); its `_moe_plan` picks the launch order by rows."""

from __future__ import annotations

from collections.abc import Callable

import torch

from megastep.kernels import linear_fp8 as _lin
from megastep.kernels import moe as _moe
from megastep.kernels import pair_combine as _pairs
from megastep.kernels import route_cuda as _route_cuda
from megastep.kernels import router as _router
from megastep.model import ops
from megastep.runtime.distributed import ordered_combine
from megastep.runtime.sidecar import CpuSidecar
from megastep.runtime.trace import stage


class MoeSublayer:
    """FastDecoder's MoE methods (a mixin)."""

    def _cpu_experts(self, L: int, cold: list[int], placement, cold_path: str, cpu_share: float) -> list[int]:
        """The cold experts of layer L that the CPU computes: none (recipe A), all (B), or (hybrid)
        a greedy split by expected routing share, hottest first, each to the path whose load over
        its bandwidth share is lower."""
        if cold_path == "gpu" or not cold:
            return []
        if cold_path == "cpu":
            return list(cold)
        shares = placement.shares[L]
        load = {"cpu": 0.0, "gpu": 0.0}
        cpu = []
        for e in sorted(cold, key=lambda e: (-shares[e], e)):
            side = "cpu" if load["cpu"] / max(cpu_share, 1e-9) <= load["gpu"] / max(1.0 - cpu_share, 1e-9) else "gpu"
            load[side] += shares[e] or 1e-12
            if side == "cpu":
                cpu.append(e)
        return sorted(cpu)

    def _place_experts(self, L: int, st: dict[str, torch.Tensor], cold: list[int], cpu: list[int]) -> _moe.ExpertTable:
        """One layer's stacked (owned) experts -> the experts kernel's address table: the hot
        experts stacked in device memory, the cold ones stacked in page-locked host memory, the
        experts of other ranks and those the CPU computes (`cpu`, handed to the sidecar) absent."""
        keys = ("w13", "w13_scale", "w2", "w2_scale")
        dev = self.device
        E = self.cfg.n_routed_experts
        if not cold and len(self.owned) == E:
            return _moe.ExpertTable.from_stacked(*(st[k].to(dev) for k in keys))
        cold_set, cpu_set = set(cold) - set(cpu), set(cpu)
        hot = [i for i, e in enumerate(self.owned) if e not in cold_set and e not in cpu_set]  # positions in st
        on_cpu = [i for i, e in enumerate(self.owned) if e in cpu_set]
        cold = [i for i, e in enumerate(self.owned) if e in cold_set]

        def take(t: torch.Tensor, ids: list[int], host: bool) -> torch.Tensor:
            raw = t.view(torch.uint8) if t.dtype == torch.float8_e8m0fnu else t  # index ops on bytes
            sel = raw.index_select(0, torch.tensor(ids, device=t.device))
            if host:
                dst = torch.empty(sel.shape, dtype=sel.dtype, pin_memory=dev.type == "cuda")
                sel = dst.copy_(sel)
            else:
                sel = sel.to(dev)
            return sel.view(t.dtype)

        if on_cpu:
            if self.sidecar is None:
                self.sidecar = CpuSidecar(dev, self.cfg.swiglu_limit)
            self.sidecar.add_layer(L, {k: take(st[k], on_cpu, True) for k in keys}, [self.owned[i] for i in on_cpu], E)
        hot_st = [take(st[k], hot, False) for k in keys] if hot else []
        cold_st = [take(st[k], cold, True) for k in keys] if cold else []
        experts: list = [None] * E
        for j, i in enumerate(hot):
            experts[self.owned[i]] = tuple(t[j] for t in hot_st)
        for j, i in enumerate(cold):
            experts[self.owned[i]] = tuple(t[j] for t in cold_st)
        return _moe.ExpertTable.from_experts(experts, device=dev)

    def _moe(self, x, tokens, L):
        cfg = self.cfg
        lw = self.layers[L]
        T = self.trace
        w1, w3, w2 = lw["shared"]
        fused = self.triton and "shared13" in lw
        # expert parallelism over peer loads: the whole shared expert runs beside the routed experts
        # and the combine kernel adds it (w2's residual epilogue, the same bits), so w2 does not
        # wait for the other ranks
        whole_shared = fused and self.peer is not None and "experts" in lw
        router, after_router, shared_w2 = self._moe_plan(x.shape[0])
        # one GPU: the whole shared expert beside the routed experts as well, its output added by
        # their combine or by the next mHC launch (shared_w2)
        side_w2 = (fused and shared_w2 != "residual" and self.world_size == 1 and "experts" in lw
                   and not lw.get("cpu_experts", False))
        in_combine = side_w2 and shared_w2 == "combine"
        # MOE_PAIRS_ROWS: the routed pairs' outputs to the next mHC launch, which sums them with the shared output
        pairs_to_mhc = (side_w2 and shared_w2 == "mhc" and self.triton and x.dtype == torch.bfloat16
                        and self._pairs_to_mhc(x.shape[0]))

        def shared_half() -> torch.Tensor:
            with self._on_side(), stage(T, "shared_expert", L):  # its gated half beside the routed experts
                if fused:  # gated w1/w3 + SwiGLU in one launch
                    a = _lin.linear_fp8_swiglu(x.contiguous(), *lw["shared13"], cfg.swiglu_limit, out_dtype=x.dtype)
                    return w2(a, True) if whole_shared or side_w2 else a
                return ops.swiglu(w1(x, self.triton), w3(x, self.triton), cfg.swiglu_limit).to(x.dtype)

        if not after_router:
            a = shared_half()
        with stage(T, "router", L):
            # sqrtsoftplus scores, bias top-k (or the hash rows), ids ascending (the reference's
            # summation order), normalized weights times the routed scaling
            idx, w, routing = (self._route_cuda if router == "cuda" else self._route_triton)(x, tokens, lw)
        if self.route_log is not None:
            self.route_log.append((L, idx.clone()))
        if after_router:  # the side stream forks after the router: beside the experts only
            a = shared_half()
        with stage(T, "routed_experts", L):
            if in_combine:  # the main stream joins the side stream just before the experts' last launch
                return self._routed(x, idx, w, lw, L, routing, shared=lambda: self._joined(a))()
            routed = self._routed(x, idx, w, lw, L, routing, pairs=pairs_to_mhc)
        self._join(a)
        # the routed parts of other ranks or of the CPU (sidecar) were in flight during the shared
        # expert's first half and join here (with several ranks, an eager step's trace counts the
        # wait for the slowest one in this stage)
        with stage(T, "expert_combine", L):
            if whole_shared:  # a is the shared expert's output
                return routed(a)
            r = routed()
        if side_w2:  # the next mHC launch adds the shared expert's output a (its y2) to the routed sum
            return (r.transpose(0, 1) if pairs_to_mhc else r), a  # (the pairs [k, B, D], slot-major)
        with stage(T, "shared_expert", L):
            if fused:  # w2 + the routed sum in one launch
                return _lin.linear_fp8(a, w2.w, w2.scale, block=w2.block, out_dtype=x.dtype, residual=r)
            return (r + w2(a, self.triton).float()).to(x.dtype)

    def _route_cuda(self, x, tokens, lw):
        """The gate GEMV, then route_cuda's one launch: routing (a hash layer's rows looked up
        inside), the pairs grouped and x quantized for the experts -> (idx, w, routing or None).
        Up to route_cuda.FUSED_GATE_ROWS rows the gate GEMV runs inside that launch (the same bits)."""
        cfg = self.cfg
        k = cfg.num_experts_per_tok
        group = "experts" in lw and x.dtype == torch.bfloat16 and x.shape[0] * k <= _route_cuda.MAX_GROUPED_PAIRS
        if group and self.triton and _route_cuda.fused_gate_ok(x, lw["gate"], k):
            return _route_cuda.gate_route_group(x, lw["gate"], lw.get("gate_bias"), lw.get("tid2eid"),
                                                tokens.contiguous() if "tid2eid" in lw else None, k,
                                                cfg.routed_scaling_factor, permute=_moe.permutes(self.moe_mode))
        return _route_cuda.route_group(self._dense(x, lw["gate"]).contiguous(), lw.get("gate_bias"), lw.get("tid2eid"),
                                       tokens.contiguous() if "tid2eid" in lw else None, k, cfg.routed_scaling_factor,
                                       x.contiguous() if group else None, permute=_moe.permutes(self.moe_mode))

    def _route_triton(self, x, tokens, lw):
        """router.py's launches -> (idx, w, routing or None): by batch, the gate, routing, grouping
        and x quantization in one launch, or the gate apart, or the grouping left to the experts."""
        cfg = self.cfg
        hash_rows = lw["tid2eid"][tokens] if "tid2eid" in lw else None
        k, scaling, gate = cfg.num_experts_per_tok, cfg.routed_scaling_factor, lw["gate"]
        grouped = self.triton and "experts" in lw and x.shape[0] * k <= _router.MAX_GROUPED_PAIRS
        if grouped and x.shape[0] <= _router.MAX_GATE_ROWS and x.dtype == gate.dtype == torch.bfloat16:
            idx, w, routing, _ = _router.gate_route_group(x.contiguous(), gate, lw.get("gate_bias"), hash_rows, k,
                                                          scaling, permute=_moe.permutes(self.moe_mode))
            return idx, w, routing
        route_args = (self._dense(x, gate).contiguous(), lw.get("gate_bias"), hash_rows, k, scaling)
        if grouped:
            return _router.route_group(*route_args, x.contiguous(), permute=_moe.permutes(self.moe_mode))
        return (*self._kernel(_router, "route")(*route_args), None)

    def _moe_config(self, x, idx, table):
        if self.moe_mode is None:
            return None  # the kernel's pick
        return _moe.pick_config(x.shape[0], idx.shape[1], table.E, table.D, table.I, mode=self.moe_mode)

    def _routed(self, x, idx, w, lw, L, routing=None, shared=None, pairs=False) -> Callable[[], torch.Tensor]:
        """Launch the routed experts; returns the function that gives their sum [B, D] once the
        parts computed elsewhere (other ranks, the CPU) have arrived. routing: idx's pairs grouped
        and x quantized by the router's launch (`router.route_group`), or None. shared (one part
        only: the experts table in this process): `moe_experts_table`'s shared, the sum is then
        rnd(routed + shared) in shared's dtype. pairs (one part only): the per-pair outputs [B, k, D]
        unsummed instead (MOE_PAIRS_ROWS)."""
        cfg = self.cfg
        if "experts_plain" in lw:  # unquantized checkpoints: a slow loop
            y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            for j in range(idx.shape[1]):
                for b in range(x.shape[0]):
                    w1, w3, w2 = lw["experts_plain"][int(idx[b, j])]
                    a = (w[b, j] * ops.swiglu(w1(x[b:b + 1], False), w3(x[b:b + 1], False), cfg.swiglu_limit)).to(x.dtype)
                    y[b] += w2(a, False)[0].float()
            return lambda: y
        # Experts computed in parts (the CPU's beside the GPU's, or other ranks'): this process's
        # per-slot outputs, the other parts added bit-exactly, then the slot-order sum the
        # one-part kernel makes.
        split = self.world_size > 1 or lw.get("cpu_experts", False)
        assert not (pairs and split), "the pairs unsummed of a one-part experts call only"
        job = self.sidecar.start(L, x, idx, w) if lw.get("cpu_experts") else None  # runs beside the kernel below
        if "experts" in lw:
            peer = self.peer is not None  # the pairs written where the other ranks read them
            assert shared is None or not split, "shared in the combine of a one-part experts call only"
            out = _moe.moe_experts_table(x.contiguous(), idx, w, lw["experts"], swiglu_limit=cfg.swiglu_limit,
                                         config=self._moe_config(x, idx, lw["experts"]), return_pairs=split or pairs,
                                         pairs_out=self.peer.buffer(L, idx.numel()) if peer else None,
                                         routing=routing, shared=shared)
            if peer:
                return lambda shared=None: self.peer.combine(L, idx, len(self.owned), shared)
        else:
            ex = lw["experts_stacked"]
            out = _moe.moe_experts_mxfp4_ref(x, idx, w, ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"],
                                             swiglu_limit=cfg.swiglu_limit, return_pairs=split or pairs,
                                             expert_ids=self.owned)
        if not split:
            return lambda: out
        work = ordered_combine(out, self.group, async_op=True) if self.world_size > 1 else None

        def routed_sum() -> torch.Tensor:
            pairs = out
            if job is not None:  # one rank only: the sidecar and EP do not mix (checked at init)
                pairs = self.sidecar.finish(job, pairs)
            if work is not None:
                work.wait()
            return _pairs.sum_pairs(pairs) if self.triton else _moe.sum_pairs(pairs)
        return routed_sum
