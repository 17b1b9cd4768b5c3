"""The decoding step (:func:`.decode.decode_forward`) replayed from CUDA graphs.

A step of the Qwen3-30B-A3B slice launches a few hundred small kernels; replayed from a CUDA
graph it costs one launch, so the GPU runs at the speed of its memory instead of the host's
(vLLM and SGLang decode this way; Megatron's dynamic engine captures its own decode steps with
``cuda_graph_impl="local"``, but through flash-attn and drop-and-pad MoE). The step has no host
read and fixed shapes per ``(rows, key window)``, so it captures as it is: :class:`GraphedDecode`
holds one graph per bucket (rows rounded up to a power of two, the key window to a multiple of
``WINDOW_STEP`` keys within a block, whole blocks beyond) and replays it with the step's inputs
copied into the graph's own tensors. Padded rows read and write one scratch KV slot (Megatron's
dummy block), their outputs are dropped.

What the graphs hold, and for how long:

- **One memory pool and one warm-up stream** for every bucket (:class:`CudaGraphs`): the
  buckets never run at once, so they share the pool, captured largest first
  (:meth:`GraphedDecode.prepare`) so the smaller ones reuse its blocks; one side stream warms
  every capture up (a new stream per capture strands each warm-up's peak in the caching
  allocator).
- **The storage they read, in their key** (:func:`storage_key`): the KV buffer's address and
  every weight tensor's (``data_ptr``, shape, stride). In-place updates (the optimizer's) are
  read by the replay and need nothing; a tensor that moved (a resume's new KV buffer, a call's
  new expert stack) makes every graph stale, and they are dropped.
- **A call's lifetime**: :meth:`GraphedDecode.release` (at the end of every ``generate``) drops
  the graphs and their pool (they read the call's stacked experts, freed then too); the next
  call's ``begin()`` re-captures, largest first, the buckets the last call met (a bounded set),
  so the steady RL loop captures at ``begin()``, not inside a round; a bucket never met before
  is captured at its round's first step.
- **A capture that raises** falls back to the eager step for the engine's life, with one WARNING
  line and ``rollout/decode_graphs`` 0 (:meth:`GraphedDecode.metrics`).

On CPU the same buckets and padding run eagerly (:class:`EagerBuckets`: what the CPU tests check,
with a fake graph backend standing in for the capture).
"""

from __future__ import annotations

import logging

import torch

from gspo_megatron.backends.megatron.kernels.decode import DecodeBatch, KeyGroup, decode_forward

WINDOW_STEP = 64
"""Key windows within a block are captured in steps of this many keys."""

log = logging.getLogger(__name__)


def _bucket(rows: int) -> int:
    return 1 << max(0, (rows - 1).bit_length())


def storage_key(w, kv: torch.Tensor) -> tuple:
    """What a captured graph reads, by storage: ``kv``'s address and every tensor of ``w`` (a
    :class:`~.decode.DecodeWeights`, its layers and their modules' parameters) as ``(data_ptr,
    shape, stride)``. Not the tensors' versions: an in-place update is read by the replay."""
    seen: list = []

    def add(t) -> None:
        if torch.is_tensor(t):
            seen.append((t.data_ptr(), tuple(t.shape), tuple(t.stride())))
        elif isinstance(t, torch.nn.Module):
            for p in t.parameters():
                add(p)

    for value in vars(w).values():
        add(value)
    for layer in getattr(w, "layers", ()):
        for value in vars(layer).values():
            add(value)
    return (kv.data_ptr(), tuple(kv.shape), tuple(seen))


def _eager(w, kv, batch, record_routes: bool, sample):
    """The step (and ``sample`` of its logits) without graphs."""
    logits, routes = decode_forward(w, kv, batch, record_routes)
    return (logits if sample is None else sample(logits)), routes


class EagerBuckets:
    """The graph backend of a CPU run: a "capture" is the bucket's step function itself."""

    def capture(self, run, generators=()):
        return run

    def release(self) -> None:
        pass

    def reserved(self) -> int:
        return 0


class CudaGraphs:
    """CUDA graphs sharing one memory pool, warmed up on one side stream."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream()

    def capture(self, run, generators=()):
        # warm-up on the side stream (lazy initialisation must not happen inside the capture);
        # the KV writes go to the scratch slot only
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        for generator in generators:  # (a sampler's: each replay advances its offset)
            graph.register_generator_state(generator)
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            outputs = run()

        def replay():
            graph.replay()
            return outputs
        replay.graph = graph  # (the replay holds the graph, the graph its pool's blocks)
        return replay

    def release(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()  # (the old pool goes with its graphs)

    def reserved(self) -> int:
        return torch.cuda.memory_reserved()


class GraphedDecode:
    """Callable as :func:`.decode.decode_forward`: the same outputs, replayed from CUDA graphs.
    ``scratch_slot``: a flat KV slot no request uses (padded rows write there); ``backend``:
    :class:`CudaGraphs` (default on CUDA), :class:`EagerBuckets` (default otherwise) or a test's
    stand-in (``capture(run) -> replay``, ``release()``, ``reserved()``)."""

    def __init__(self, scratch_slot: int, block_size: int, backend=None):
        self.scratch_slot = int(scratch_slot)
        self.block_size = int(block_size)
        self.backend = backend
        self.graphs: dict = {}
        self.met: dict[tuple, object] = {}
        """Bucket keys replayed since the engine was built, with their sampler (what
        :meth:`prepare` re-captures)."""
        self._captured_on: tuple | None = None
        """:func:`storage_key` the graphs were captured on."""
        self.captures = 0
        """Graphs captured so far (one per bucket, again after what they read moved)."""
        self.captured: list[tuple] = []
        """Their bucket keys ``(rows, window, routes, one block, sampler)``, in capture
        order."""
        self.failed: str | None = None
        """Why a capture raised (the step then runs eagerly for the engine's life), or None."""
        self._checked: tuple | None = None
        """``(weights, kv)`` of the call whose storage was checked (dropped by :meth:`release`)."""
        self.reserved_after_capture: list[int] = []
        """The backend's reserved bytes after each capture (``torch.cuda.memory_reserved``)."""

    def window(self, keys: int) -> int:
        """The key window a step of ``keys`` keys runs at: a multiple of ``WINDOW_STEP`` within
        one block (the keys read as one run per request), whole blocks beyond."""
        if keys <= self.block_size:
            return min(-(-keys // WINDOW_STEP) * WINDOW_STEP, self.block_size)
        return -(-keys // self.block_size) * self.block_size

    def _backend(self, kv: torch.Tensor):
        if self.backend is None:
            self.backend = CudaGraphs() if kv.is_cuda else EagerBuckets()
        return self.backend

    def _check_storage(self, w, kv: torch.Tensor) -> None:
        if self._checked is not None and self._checked[0] is w and self._checked[1] is kv:
            return  # (checked for this call's weights: a walk over every tensor costs ~1 us each)
        self._checked = (w, kv)
        key = storage_key(w, kv)
        if key != self._captured_on:  # something a graph reads moved: every graph is stale
            self.graphs.clear()
            self._captured_on = key

    def prepare(self, w, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Capture the buckets met so far (a bounded set) for ``w`` and ``kv``, largest first
        (the pool's first graph sizes it; the others reuse its blocks): at a call's ``begin()``,
        so its rounds replay without capturing."""
        if self.failed is not None:
            return
        self._check_storage(w, kv)
        for key in sorted(self.met, key=lambda k: (k[0] * k[1], k[:4]), reverse=True):
            if key not in self.graphs:
                self._capture_key(w, kv, key, kv.device, cos, sin, self.met[key])
                if self.failed is not None:
                    return

    def release(self) -> None:
        """Drop every graph and the pool they share (the end of a ``generate``): nothing of
        them outlives the call; :attr:`met` stays, for the next :meth:`prepare`."""
        self.graphs.clear()
        self._captured_on = self._checked = None
        if self.backend is not None:
            self.backend.release()

    def metrics(self) -> dict[str, float]:
        """``rollout/decode_graphs`` (1: replayed from graphs, 0: eager after a capture
        raised), ``rollout/decode_graph_captures`` (so far)."""
        return {"rollout/decode_graphs": float(self.failed is None),
                "rollout/decode_graph_captures": float(self.captures)}

    def __call__(self, w, kv: torch.Tensor, batch: DecodeBatch, record_routes: bool = False,
                 sample=None):
        """:func:`~.decode.decode_forward`'s ``(logits [B, V], routes)``; with ``sample`` (a
        callable ``logits -> (tokens [B], logprobs [B])`` with a ``key`` and a ``generator``,
        captured with the step, its generator registered with the graph):
        ``((tokens, logprobs), routes)``."""
        if self.failed is not None:
            return _eager(w, kv, batch, record_routes, sample)
        (group,) = batch.groups  # (the rounds hand graphs one group of every row)
        B, Lk = group.key_rows.shape
        key = (_bucket(B), self.window(Lk), bool(record_routes), group.key_blocks is not None,
               None if sample is None else sample.key)
        self._check_storage(w, kv)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture_key(w, kv, key, batch.tokens.device, batch.cos, batch.sin,
                                      sample)
            if entry is None:  # the capture raised: eager from now on
                return _eager(w, kv, batch, record_routes, sample)
        self.met[key] = sample
        static, replay = entry
        self._fill(static, batch, B, Lk)
        out, routes = replay()
        # (the next replay overwrites the graph's outputs: the caller consumes the logits or
        # tokens at once, the routes are kept for the round, so they are copied)
        out = out[:B] if sample is None else (out[0][:B].clone(), out[1][:B].clone())
        return out, (routes[:, :B].clone() if routes is not None else None)

    def _capture_key(self, w, kv, key: tuple, device, cos, sin, sample):
        """Capture bucket ``key``; None (and :attr:`failed` set, one WARNING) if it raises."""
        rows, window, record_routes, blocks, _ = key
        try:
            entry = self.graphs[key] = self._capture(w, kv, device, cos, sin, rows, window,
                                                     record_routes, blocks, sample)
        except Exception as exc:  # noqa: BLE001 (any capture error: eager is always correct)
            self.failed = f"{type(exc).__name__}: {exc}"
            self.graphs.clear()
            log.warning("rollout.decode_cuda_graphs: capturing the decoding step failed (%s); "
                        "decoding eagerly from now on (rollout/decode_graphs 0)", self.failed)
            return None
        self.captured.append(key)
        self.reserved_after_capture.append(self._backend(kv).reserved())
        return entry

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

    def _capture(self, w, kv, device, cos, sin, rows: int, window: int, record_routes: bool,
                 blocks: bool, sample=None):
        group = KeyGroup(
            rows=None,
            key_rows=torch.full((rows, window), self.scratch_slot, dtype=torch.long,
                                device=device),
            key_mask=torch.zeros(rows, window, dtype=torch.bool, device=device),
            positions=torch.arange(window, device=device),
            key_blocks=(torch.full((rows,), self.scratch_slot // self.block_size,
                                   dtype=torch.long, device=device) if blocks else None))
        group.key_mask[:, 0] = True
        static = DecodeBatch(
            tokens=torch.zeros(rows, dtype=torch.long, device=device),
            positions=torch.zeros(rows, dtype=torch.long, device=device),
            slots=torch.full((rows,), self.scratch_slot, dtype=torch.long, device=device),
            cos=cos, sin=sin, groups=[group])

        def run():
            return _eager(w, kv, static, record_routes, sample)
        replay = self._backend(kv).capture(
            run, generators=() if sample is None or sample.generator is None
            else (sample.generator,))
        self.captures += 1
        return static, replay
