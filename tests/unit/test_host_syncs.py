"""The host-synchronisation counter of tools/bench/host_syncs.py (issue 48's baseline): every
kind of read it names is counted once per call, including inside inference mode, and nothing is
counted for ops that keep values on the device; the wrapped methods are restored on exit."""

import torch

from tools.bench.host_syncs import HostSyncCounter


def test_each_host_read_is_counted_once_and_methods_are_restored():
    x = torch.tensor([1.0, 2.0, 3.0])
    before = torch.Tensor.item
    with HostSyncCounter() as c:
        y = (x * 2).cumsum(0)[x > 1.5]  # mask indexing: 1 (output size from values)
        _ = y.sum().item(), bool((x > 0).all()), int(x[0]), float(x[1])  # 4 scalar reads
        _ = x.tolist(), torch.nonzero(x), x.masked_select(x > 2)  # 3
        with torch.inference_mode():
            _ = x.max().item()  # 1
        _ = torch.where(x > 1, x, -x).sort().values  # none: values stay on the device
    assert c.total == 9, c.sites
    assert c.sites["mask indexing"] == 1 and c.sites["item"] == 2
    assert torch.Tensor.item is before and "__getitem__" not in vars(torch.Tensor)
    assert torch.tensor([x.sum()]).shape == (1,)  # a 0-d tensor is no Python sequence again
