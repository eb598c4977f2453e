"""Ranks of a peer-to-peer combine simulated in one process (kernels/pair_combine.py,
kernels/split_combine.py): every rank's buffer and flags are plain tensors whose addresses go into
the tables the kernels read, as symmetric memory's would."""

import torch


def arrived(bufs: list[torch.Tensor], layers: int, layer: int, epoch: int, dev):
    """(flags, epoch, table, flag table) for ranks with buffers `bufs`: every rank's flags [layers, W]
    hold `epoch` at `layer` (every rank has arrived there: the wait passes at once), zero elsewhere."""
    world = len(bufs)
    flags = [torch.zeros(layers, world, dtype=torch.int64, device=dev) for _ in bufs]
    for f in flags:
        f[layer] = epoch
    table = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=dev)
    ftable = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64, device=dev)
    return flags, torch.tensor([epoch], dtype=torch.int64, device=dev), table, ftable
