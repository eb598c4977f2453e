"""A captured CUDA graph instantiated to run with its kernel nodes' own priorities.

torch instantiates a graph without CUDA's "use node priority" flag, so every kernel of a replay
runs at the priority of the stream the replay is launched on, whatever the priority of the stream
it was captured from (stream capture copies that priority into each kernel node). This module
instantiates torch's kept graph (`torch.cuda.CUDAGraph(keep_graph=True)`) itself, through the CUDA
driver (ctypes on libcuda, which every CUDA machine has: no new package), with that flag, and
launches it. What a kernel computes does not depend on its priority: only which waiting thread
blocks the scheduler places first.

Used by runtime/step.py under NODE_PRIORITY (a timing probe, off).
"""

from __future__ import annotations

import ctypes
import functools

import torch

_USE_NODE_PRIORITY = 8  # CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuGraphInstantiateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_ulonglong]
    lib.cuGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.cuGraphExecDestroy.argtypes = [ctypes.c_void_p]
    for f in (lib.cuGraphInstantiateWithFlags, lib.cuGraphLaunch, lib.cuGraphExecDestroy):
        f.restype = ctypes.c_int
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed: CUDA driver error {rc}")


class PriorityGraph:
    """`launch(stream)` runs `graph` (captured with keep_graph=True, not instantiated by torch)
    with its kernel nodes' priorities. Keeps `graph` (its memory pool) alive."""

    def __init__(self, graph: torch.cuda.CUDAGraph):
        if not hasattr(graph, "raw_cuda_graph"):
            raise RuntimeError("this torch cannot hand out its captured graph (CUDAGraph.raw_cuda_graph)")
        self.graph = graph
        self._exec = ctypes.c_void_p()
        _check(_driver().cuGraphInstantiateWithFlags(ctypes.byref(self._exec), ctypes.c_void_p(graph.raw_cuda_graph()),
                                                     _USE_NODE_PRIORITY), "cuGraphInstantiateWithFlags")

    def launch(self, stream: torch.cuda.Stream) -> None:
        _check(_driver().cuGraphLaunch(self._exec, ctypes.c_void_p(stream.cuda_stream)), "cuGraphLaunch")

    def __del__(self):
        if self._exec:
            _driver().cuGraphExecDestroy(self._exec)
            self._exec = ctypes.c_void_p()
