"""The local spec's context-parallel attention on 2 and 3 gloo processes against one process,
float64: each rank's output and the gradients of its query/key/value shares equal the matching
positions of the whole row's (the key/value all-gather's backward sums every rank's share).

* padded rows (``row_attention.context_parallel_sdpa``, :class:`~gspo_megatron.layout.ContextShard`)
  against causal SDPA on the whole rows;
* a packed row of a long-tailed batch (``packed_context_parallel_sdpa``, each sequence cut into
  2 x CP chunks, :meth:`~gspo_megatron.layout.PackedRows.context_index`) against the packed
  kernel on the whole row (``packed_sdpa``, itself checked against each sequence alone in
  tests/unit/test_packing.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from tests.helpers import warm
from tests.helpers.dist import free_port

pytestmark = pytest.mark.distributed

HEADS, GROUPS, DIM, SCALE = 4, 2, 8, 0.3
LENGTHS = [3, 40, 5, 17, 1, 9, 33, 2, 11]  # several length groups, sequences shorter than 2 CP


def _inputs(total: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(total, HEADS, DIM, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(total, GROUPS, DIM, generator=gen, dtype=torch.float64) for _ in range(2))
    cotangent = torch.randn(total, HEADS, DIM, generator=gen, dtype=torch.float64)
    return q, k, v, cotangent


def _check(local_out, local_inputs, ref_out, ref_grads, index, cotangent):
    torch.testing.assert_close(local_out, ref_out[index], rtol=0, atol=1e-12)
    grads = torch.autograd.grad(local_out, local_inputs, cotangent[index])
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want[index], rtol=0, atol=1e-12)


def _worker(rank: int, size: int, port: int) -> None:
    from gspo_megatron.backends.megatron.kernels.row_attention import (context_parallel_sdpa,
                                                               packed_context_parallel_sdpa,
                                                               packed_sdpa)
    from gspo_megatron.layout import ContextShard, PackedRows

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    try:
        group = dist.new_group(list(range(size)))
        shard = ContextShard(rank, size)

        # Padded rows [T, b, heads, hn]: b = 2 rows of T = 4 x 2 CP.
        t, b = 8 * size, 2
        q, k, v, cot = (x.reshape(t, b, *x.shape[1:]) for x in _inputs(t * b, 1))
        qf, kf, vf = (x.clone().requires_grad_() for x in (q, k, v))
        ref = F.scaled_dot_product_attention(*(x.permute(1, 2, 0, 3) for x in (qf, kf, vf)),
                                             is_causal=True, scale=SCALE, enable_gqa=True)
        ref = ref.permute(2, 0, 1, 3)  # [T, b, heads, hn]
        ref_grads = torch.autograd.grad(ref, (qf, kf, vf), cot)
        index = shard.positions(t)
        local = tuple(x[index].clone().requires_grad_() for x in (q, k, v))
        out = context_parallel_sdpa(*local, group, SCALE).view(t // size, b, HEADS, DIM)
        _check(out, local, ref.detach(), ref_grads, index, cot)

        # A packed row: every sequence (and the tail pad) rounded up to 2 CP, the row to 4 CP.
        packing = PackedRows.of(torch.tensor(LENGTHS), 4 * size, 2 * size)
        cu = packing.cu_seqlens()
        params = SimpleNamespace(cu_seqlens_q=packing.cu_seqlens_real(), cu_seqlens_q_padded=cu,
                                 max_seqlen_q=packing.max_seqlen())
        q, k, v, cot = _inputs(packing.total, 2)
        qf, kf, vf = (x.clone().requires_grad_() for x in (q, k, v))
        ref = packed_sdpa(qf, kf, vf, params, SCALE)
        ref_grads = torch.autograd.grad(ref, (qf, kf, vf), cot)
        index = packing.context_index(shard)
        local = tuple(x[index].clone().requires_grad_() for x in (q, k, v))
        out = packed_context_parallel_sdpa(*local, params, group, SCALE)
        _check(out, local, ref.detach(), ref_grads, index, cot)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("size", [2, 3])
def test_context_parallel_attention_matches_one_process(size):
    warm.gloo_context()  # the warm forkserver: not pytest's fork (it may hold a process group)
    mp.start_processes(_worker, args=(size, free_port()), nprocs=size, join=True,
                       start_method="forkserver")
