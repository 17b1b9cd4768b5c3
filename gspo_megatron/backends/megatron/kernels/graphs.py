"""The decoding step (:func:`.decode.decode_forward`) replayed from CUDA graphs.

A step of the Qwen3-30B-A3B slice launches a few hundred small kernels; replayed from a CUDA
graph it costs one launch, so the GPU runs at the speed of its memory instead of the host's
(vLLM and SGLang decode this way; Megatron's dynamic engine captures its own decode steps with
``cuda_graph_impl="local"``, but through flash-attn and drop-and-pad MoE). The step has no host
read and fixed shapes per ``(rows, key window)``, so it captures as it is: :class:`GraphedDecode`
captures one graph per bucket (rows rounded up to a power of two, the key window to a multiple
of ``WINDOW_STEP`` keys within a block, whole blocks beyond) the first time the bucket is met, and replays it with the step's inputs
copied into the graph's own tensors. Padded rows read and write one scratch KV slot (Megatron's
dummy block), their outputs are dropped.

A graph holds the addresses it captured: the KV buffer (re-captured when the engine allocates it
anew after a suspend), the weights (:class:`~..engine.rounds.FastDecoder` keeps the stacked
experts in tensors of its own, refreshed in place each call) and the step's input tensors.
On CPU the same buckets and padding run eagerly (the engine uses it on CUDA only; the tests
compare its padded buckets with the plain step there).
"""

from __future__ import annotations

import dataclasses

import torch

from gspo_megatron.backends.megatron.kernels.decode import DecodeBatch, KeyGroup, decode_forward


WINDOW_STEP = 64
"""Key windows within a block are captured in steps of this many keys."""


def _bucket(rows: int) -> int:
    return 1 << max(0, (rows - 1).bit_length())


class GraphedDecode:
    """Callable as :func:`.decode.decode_forward`: the same outputs, replayed from CUDA graphs.
    ``scratch_slot``: a flat KV slot no request uses (padded rows write there)."""

    def __init__(self, scratch_slot: int, block_size: int):
        self.scratch_slot = int(scratch_slot)
        self.block_size = int(block_size)
        self.graphs: dict = {}
        self._captured_on: tuple[int, int] = (0, 0)
        """``(KV buffer address, weights id)`` the graphs were captured on."""
        self.captures = 0
        """Graphs captured so far (one per bucket, again after the KV buffer moved)."""

    def window(self, keys: int) -> int:
        """The key window a step of ``keys`` keys runs at: a multiple of ``WINDOW_STEP`` within
        one block (the keys read as one run per request), whole blocks beyond."""
        if keys <= self.block_size:
            return min(-(-keys // WINDOW_STEP) * WINDOW_STEP, self.block_size)
        return -(-keys // self.block_size) * self.block_size

    def __call__(self, w, kv: torch.Tensor, batch: DecodeBatch, record_routes: bool = False):
        (group,) = batch.groups  # (the rounds hand graphs one group of every row)
        B, Lk = group.key_rows.shape
        rows = _bucket(B)
        window = self.window(Lk)
        if (kv.data_ptr(), id(w)) != self._captured_on:  # the KV buffer moved (a resume
            self.graphs.clear()  # allocated it anew): every graph points at the old one
            self._captured_on = (kv.data_ptr(), id(w))
        key = (rows, window, bool(record_routes), group.key_blocks is not None)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(w, kv, batch, rows, window, record_routes)
        static, replay = entry
        self._fill(static, batch, B, Lk)
        logits, routes = replay()
        # (the next replay overwrites the graph's outputs: the caller consumes the logits at
        # once, the routes are kept for the round, so they are copied)
        return logits[:B], (routes[:, :B].clone() if routes is not None else None)

    def _fill(self, static: DecodeBatch, batch: DecodeBatch, B: int, Lk: int) -> None:
        """The step's inputs into the graph's tensors; padded rows and keys point at the scratch
        slot, a padded row sees its one (scratch) key so no softmax row is empty."""
        mine, got = static.groups[0], batch.groups[0]
        static.tokens[:B].copy_(batch.tokens)
        static.positions[:B].copy_(batch.positions)
        static.slots[:B].copy_(batch.slots)
        if mine.key_blocks is not None:
            mine.key_blocks[:B].copy_(got.key_blocks)
            mine.key_blocks[B:] = self.scratch_slot // self.block_size
        mine.key_rows[:B, :Lk].copy_(got.key_rows)
        mine.key_mask[:B, :Lk].copy_(got.key_mask)
        mine.key_mask[:B, Lk:] = False
        mine.key_rows[:B, Lk:] = self.scratch_slot
        if B < static.tokens.shape[0]:
            static.tokens[B:] = 0
            static.positions[B:] = 0
            static.slots[B:] = self.scratch_slot
            mine.key_rows[B:] = self.scratch_slot
            mine.key_mask[B:] = False
            mine.key_mask[B:, 0] = True

    def _capture(self, w, kv, batch: DecodeBatch, rows: int, window: int, record_routes: bool):
        device = batch.tokens.device
        got = batch.groups[0]
        group = KeyGroup(
            rows=None,
            key_rows=torch.full((rows, window), self.scratch_slot, dtype=torch.long,
                                device=device),
            key_mask=torch.zeros(rows, window, dtype=torch.bool, device=device),
            positions=torch.arange(window, device=device),
            key_blocks=(None if got.key_blocks is None else
                        torch.full((rows,), self.scratch_slot // self.block_size,
                                   dtype=torch.long, device=device)))
        group.key_mask[:, 0] = True
        static = DecodeBatch(
            tokens=torch.zeros(rows, dtype=torch.long, device=device),
            positions=torch.zeros(rows, dtype=torch.long, device=device),
            slots=torch.full((rows,), self.scratch_slot, dtype=torch.long, device=device),
            cos=batch.cos, sin=batch.sin, groups=[group])

        def run():
            return decode_forward(w, kv, static, record_routes)
        self.captures += 1
        if not kv.is_cuda:  # the same buckets and padding, run eagerly (what CPU tests check)
            return static, run
        # warm-up on a side stream (lazy initialisation must not happen inside the capture);
        # the KV writes go to the scratch slot only
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()  # its own memory pool: buckets replay in any order
        with torch.cuda.graph(graph):
            outputs = run()

        def replay():
            graph.replay()
            return outputs
        return static, replay


def persistent_weights(current, fresh):
    """``fresh`` (:class:`~.decode.DecodeWeights` of this call) with its stacked experts copied
    into ``current``'s tensors (same shapes: the same model), so graphs captured on ``current``
    read this call's weights; ``fresh`` with private copies of its experts the first time."""
    if current is None:
        layers = [dataclasses.replace(layer, **{name: getattr(layer, name).clone()
                                                for name in _derived(layer)})
                  for layer in fresh.layers]
        return dataclasses.replace(fresh, layers=layers)
    for mine, new in zip(current.layers, fresh.layers):
        for name in _derived(new):
            getattr(mine, name).copy_(getattr(new, name))
    return current


def _derived(layer) -> list[str]:
    """The layer's tensors made for this call (stacked experts, the joint QK-norm weight), not
    the model's own parameters (which graphs read in place)."""
    return [name for name in ("w1", "w2", "qk_weight")
            if torch.is_tensor(getattr(layer, name)) and
            not isinstance(getattr(layer, name), torch.nn.Parameter)]
