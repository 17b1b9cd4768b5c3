"""What the fast decoder holds, and for how long; its CUDA graphs' bookkeeping on CPU.

* After a rollout and ``suspend()`` the bytes reachable from the engine (and so its decoder) are
  what they were before the rollout: no kept copy of the experts, no graphs, no per-step
  tensors of the call (counted by walking every object reachable from the engine).
* :class:`~gspo_megatron.backends.megatron.kernels.graphs.GraphedDecode` with a stand-in graph
  backend (the CUDA capture itself needs a GPU: ``tools/gpu_check``): graphs keyed by the storage
  they read (a moved tensor re-captures, an in-place update does not), the buckets met
  re-captured largest first at ``prepare``, a capture that raises falls back to the eager step
  with one WARNING and ``rollout/decode_graphs`` 0.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch

from tests.unit.test_rollout import EOS, PAD, VOCAB, make_prompts, setup  # noqa: F401

pytestmark = pytest.mark.slow  # builds Megatron models


def reachable_bytes(*roots) -> int:
    """Bytes of the distinct tensor storages reachable from ``roots`` (attributes, containers,
    closures), each storage once."""
    storages: dict[int, int] = {}
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool,
                                                              type, types.ModuleType)):
            continue
        seen.add(id(obj))
        if torch.is_tensor(obj):
            if obj.device.type != "meta":
                s = obj.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, types.FunctionType):
            stack.extend(c.cell_contents for c in (obj.__closure__ or ()) if _filled(c))
            stack.extend(vars(obj).values())
        elif isinstance(obj, types.MethodType):
            stack.append(obj.__self__)
        else:
            stack.extend(getattr(obj, "__dict__", {}).values())
            for name in getattr(type(obj), "__slots__", ()):
                stack.append(getattr(obj, name, None))
    return sum(storages.values())


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


class FakeGraphs:
    """A graph backend standing in for CUDA's: a capture runs the step once into outputs it
    keeps (as a graph keeps its outputs in its pool) and a pool tensor; replay reruns it.
    ``fail``: the capture raises."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.pool: list[torch.Tensor] = []

    def capture(self, run, generators=()):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.pool.append(torch.empty(4096))

        def replay():
            return run()
        return replay

    def release(self) -> None:
        self.pool = []

    def reserved(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.pool)


def _graphed_engine(setup, backend, **cfg):  # noqa: F811
    from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine
    from gspo_megatron.backends.megatron.kernels.graphs import GraphedDecode
    from gspo_megatron.config import RolloutConfig

    policy, groups = setup
    eng = RolloutEngine(policy.model, groups, eos_id=EOS, pad_id=PAD, vocab_size=VOCAB,
                        config=RolloutConfig(**{"max_new_tokens": 12, "max_batch_size": 16,
                                                "top_k": 1, **cfg}),
                        max_sequence_length=640)
    ctx = eng.dynamic.context
    fast = eng.dynamic.fast
    fast.graphs = GraphedDecode(ctx.block_allocator.dummy_block_idx * ctx.block_size_tokens,
                                ctx.block_size_tokens, backend=backend)
    return eng


def test_nothing_outlives_the_rollout(setup):  # noqa: F811
    eng = _graphed_engine(setup, FakeGraphs())
    fast = eng.dynamic.fast
    before = reachable_bytes(eng)
    during = []
    prompts = make_prompts(24, seed=3)
    for rollout in range(2):
        out = eng.generate(prompts, seed=rollout,
                           progress=lambda n: during.append((reachable_bytes(eng),
                                                             fast.provider.held_bytes())))
        assert len(out) == 24
        assert reachable_bytes(eng) == before, rollout
        assert fast.provider.held_bytes() == 0 and fast.weights is None
        assert not fast.graphs.graphs and not fast.graphs.backend.pool
    # while it ran: the KV cache, the stacked experts (held_bytes), the graphs
    assert all(b > before for b, _ in during) and all(h > 0 for _, h in during)
    # the second rollout re-captured the buckets the first met, at begin(), largest first
    graphs = fast.graphs
    first = graphs.captured[:len(graphs.met)]
    again = graphs.captured[len(first):len(first) + len(graphs.met)]
    assert sorted(again, key=lambda k: (k[0] * k[1], k), reverse=True) == again
    assert set(again) == set(graphs.met)


def test_graph_tokens_equal_eager_and_capture_failure_falls_back(setup, caplog):  # noqa: F811
    from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine
    from gspo_megatron.config import RolloutConfig

    policy, groups = setup
    prompts = make_prompts(24, seed=5)
    eager = RolloutEngine(policy.model, groups, eos_id=EOS, pad_id=PAD, vocab_size=VOCAB,
                          config=RolloutConfig(max_new_tokens=12, max_batch_size=16, top_k=1),
                          max_sequence_length=640).generate(prompts, seed=0)
    graphed = _graphed_engine(setup, FakeGraphs())
    assert [s.response_ids for s in graphed.generate(prompts, seed=0)] == \
        [s.response_ids for s in eager]
    assert graphed.dynamic.fast.metrics()["rollout/decode_graphs"] == 1.0
    failing = _graphed_engine(setup, FakeGraphs(fail=True))
    with caplog.at_level(logging.WARNING):
        got = failing.generate(prompts, seed=0)
        got2 = failing.generate(prompts, seed=0)
    assert [s.response_ids for s in got] == [s.response_ids for s in eager]
    assert [s.response_ids for s in got2] == [s.response_ids for s in eager]
    warnings = [r for r in caplog.records if "decode_cuda_graphs" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert failing.dynamic.fast.metrics() == {"rollout/decode_graphs": 0.0,
                                              "rollout/decode_graph_captures": 0.0}


def test_graphs_are_keyed_by_the_storage_they_read(setup):  # noqa: F811
    """A tensor the graphs read that moves re-captures every bucket; an in-place update (the
    optimizer's) does not, and the replay reads it."""
    from gspo_megatron.backends.megatron.kernels.decode import (DecodeBatch, DecodeWeights,
                                                                KeyGroup, decode_forward)
    from gspo_megatron.backends.megatron.kernels.graphs import GraphedDecode
    from gspo_megatron.backends.megatron.kernels.rotary import cos_sin

    policy, _ = setup
    model = policy.unwrapped()
    w = DecodeWeights.of(model)
    bs, blocks, B, Lk = 16, 8, 3, 20
    scratch = (blocks - 1) * bs
    g = torch.Generator().manual_seed(2)
    kv = torch.randn(2, len(w.layers), blocks, bs, w.groups, w.head_dim, generator=g)
    kv[:, :, blocks - 1] = 0
    pair = cos_sin(model.rotary_pos_emb(64), 1.0, torch.float32)
    table = torch.randperm(blocks - 1, generator=g)[:B * 2].view(B, 2)
    j = torch.arange(Lk)
    key_rows = table[:, j // bs] * bs + j % bs
    pos = torch.full((B,), Lk - 1)
    batch = DecodeBatch(torch.tensor([3, 5, 7]), pos, key_rows[:, -1], pair.cos, pair.sin,
                        [KeyGroup(None, key_rows, j[None, :] <= pos[:, None], j)])
    graphed = GraphedDecode(scratch, bs, backend=FakeGraphs())
    saved = w.layers[0].w1.clone()
    with torch.no_grad():
        graphed(w, kv, batch)
        graphed(w, kv, batch)
        assert graphed.captures == 1
        w.layers[0].w1.mul_(1.5)  # in place: the same storage, read by the replay
        got, _ = graphed(w, kv, batch)
        w.layers[0].w1.copy_(saved)  # (the model is the module's fixture)
        assert graphed.captures == 1
        w.layers[0].w1.mul_(1.5)
        ref, _ = decode_forward(w, kv.clone(), batch)
        w.layers[0].w1.copy_(saved)
        assert torch.allclose(got, ref, atol=1e-5)
        plain, _ = decode_forward(w, kv.clone(), batch)
        assert not torch.allclose(got, plain, atol=1e-5)  # (the update did change the step)
        moved = DecodeWeights.of(model)  # a new stack: new storage
        graphed(moved, kv, batch)
        assert graphed.captures == 2
        graphed(moved, kv.clone(), batch)  # a new KV buffer
        assert graphed.captures == 3


def test_held_state_of_other_shapes_is_prefilled_again(setup, caplog):  # noqa: F811
    """``restore_held`` into an engine of another ``max_batch_size`` (its tables of other
    sizes): nothing is loaded (one WARNING), the held requests' continuation is prefilled, and
    the responses are the uninterrupted ones (greedy); into an engine of the same shapes the
    held requests continue without a prefill, as before."""
    from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine
    from gspo_megatron.config import RolloutConfig
    from gspo_megatron.policy import HELD_REQUEST_KEY, GroupStop

    policy, groups = setup

    def build(batch):
        return RolloutEngine(policy.model, groups, eos_id=EOS, pad_id=PAD, vocab_size=VOCAB,
                             config=RolloutConfig(top_k=1, max_new_tokens=12,
                                                  max_batch_size=batch))
    saver = build(16)
    prompts = make_prompts(12, seed=6)
    whole = saver.generate(prompts, seed=0)
    first = saver.generate(prompts, seed=0, stop=GroupStop([i // 2 for i in range(12)], need=1,
                                                           hold_cut=True))
    cut = [i for i, s in enumerate(first) if s.finish_reason == "aborted"]
    state = saver.held_state()
    for batch, restored in ((8, False), (16, True)):
        eng = build(batch)
        with caplog.at_level(logging.WARNING):
            caplog.clear()
            eng.restore_held(state)
        assert bool(eng.dynamic.held_ids()) is restored
        assert any("prefilled again" in r.getMessage() for r in caplog.records) is not restored
        stop = GroupStop([i // 2 for i in cut], need=len(cut), hold_cut=True, continue_ids={
            k: first[i].extra[HELD_REQUEST_KEY] for k, i in enumerate(cut)})
        rest = eng.generate([prompts[i] + first[i].response_ids for i in cut], seed=0,
                            budgets=[12 - len(first[i].response_ids) for i in cut], stop=stop)
        written = sum(len(s.response_ids) for s in rest)
        assert (eng.dynamic.tokens_forwarded == written) is restored  # no prefill: restored
        for i, s in zip(cut, rest):
            assert first[i].response_ids + s.response_ids == whole[i].response_ids, batch


def test_sampling_inside_the_graph_reports_the_trainers_logprobs(setup):  # noqa: F811
    """Under graphs the rounds sample inside the captured step (Gumbel-max at temperature 0.8,
    the generator the graph's): each sampled token's log-prob (``logit - logsumexp``) is the
    trainer's for that token; the same seed draws the same tokens."""
    from tests.unit.test_rollout import LOGPROB_TOL, trainer_logprobs

    eng = _graphed_engine(setup, FakeGraphs(), temperature=0.8, top_k=0)
    prompts = make_prompts(12, seed=4)
    samples = eng.generate(prompts, seed=3)
    assert any(key[4] is not None and key[4][2] == "gumbel" for key in eng.dynamic.fast.graphs.met)
    worst = max((torch.tensor(s.response_logprobs) - ref).abs().max().item()
                for s, ref in zip(samples, trainer_logprobs(setup, samples, 0.8)))
    assert worst <= LOGPROB_TOL
    again = eng.generate(prompts, seed=3)
    assert [s.response_ids for s in again] == [s.response_ids for s in samples]
