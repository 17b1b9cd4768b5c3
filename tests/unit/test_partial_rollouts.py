"""Partial rollouts (:mod:`gspo_megatron.rollouts.partial`) against a scripted generator: which
requests run, with what prompt and budget, when the rollout stops, which groups a step trains on,
and that a pool restored from its state dict goes on exactly as the original."""

import random

import pytest

from gspo_megatron.rollouts.partial import PartialRollouts
from gspo_megatron.policy import HELD_REQUEST_KEY, GroupStop, RolloutSample

G, NEED, IN_FLIGHT, MAX_NEW, EOS = 2, 2, 4, 12, 99


class Example:
    def __init__(self, i):
        self.i = i


def drawer(drawn: list):
    """``draw()`` for a pool: the next ``NEED`` examples, appended to ``drawn``."""
    def draw():
        batch = [Example(len(drawn) + k) for k in range(NEED)]
        drawn.extend(batch)
        return batch
    return draw


class LengthGenerator:
    """A scripted engine: response ``r`` of prompt ``[i]`` ends (EOS included) after
    ``lengths[i][r]`` tokens, token ``t`` of it being ``10 + 20 r + t``. Every engine step first
    asks ``stop.refill`` and adds what it returns (as the real engine does), then writes one
    token of every running request; ``stop`` aborts the rest once done. Records each call's
    prompts, budgets, need and refills."""

    def __init__(self, lengths: dict[int, list[int]]):
        self.lengths, self.calls = lengths, []

    def generate(self, prompts, seed, budgets=None, stop=None):
        prompts, budgets = [list(p) for p in prompts], list(budgets)
        call = {"prompts": prompts, "budgets": budgets, "need": stop.need if stop else None,
                "refills": [], "held": (stop.hold_cut, bool(stop.continue_ids)) if stop else None,
                "continue_ids": dict(stop.continue_ids) if stop else {}}
        self.calls.append(call)
        seen: dict[int, int] = {}
        order, written, finished = [], [], []

        def add(p):  # a continued response says which it is by its first token (10 + 20 r);
            # a fresh one is the r-th fresh request of prompt p[0] in this call
            if len(p) > 1:
                order.append((p[1] - 10) // 20)
            else:
                order.append(seen.get(p[0], 0))
                seen[p[0]] = order[-1] + 1
            written.append([])
            finished.append(None)
        for p in prompts:
            add(p)
        while True:
            if stop is not None and stop.refill is not None and not stop.done:
                new = stop.refill(sum(f is None for f in finished))
                call["refills"].append(len(new))
                for p, budget, group in new:  # what the engine does with a refill
                    prompts.append(list(p))
                    budgets.append(budget)
                    stop.add(group)
                    add(p)
            if all(finished) or (stop and stop.done):
                break
            for i, p in enumerate(prompts):
                if finished[i]:
                    continue
                so_far = len(p) - 1 + len(written[i])
                end = so_far + 1 == self.lengths[p[0]][order[i]]
                written[i].append(EOS if end else 10 + 20 * order[i] + so_far)
                if written[i][-1] == EOS:
                    finished[i] = "eos"
                elif len(written[i]) == budgets[i]:
                    finished[i] = "length"
                if finished[i] and stop is not None:
                    stop.finished(i)
        self.next_id = getattr(self, "next_id", 0)
        out = []
        for p, w, f in zip(prompts, written, finished):
            extra = {}
            if f is None and stop is not None and stop.hold_cut:  # held: named by a request id
                extra[HELD_REQUEST_KEY] = self.next_id
                self.next_id += 1
            out.append(RolloutSample(list(p), w, [-0.5] * len(w), f or "aborted", extra))
        return out


def test_group_stop_counts_groups_whose_requests_all_finished():
    stop = GroupStop([0, 0, 1, 2, 2], need=2)
    for i in (0, 2):
        stop.finished(i)
    assert stop.complete == 1 and not stop.done  # group 1; group 0 waits for request 1
    stop.finished(3)
    assert not stop.done
    stop.finished(1)
    assert stop.complete == 2 and stop.done
    # with group 2 overdue the stop also waits for it
    stop = GroupStop([0, 1, 2, 2], need=1, must=frozenset({2}))
    stop.finished(0)
    stop.finished(1)
    assert stop.complete == 2 and not stop.done
    stop.finished(2)
    stop.finished(3)
    assert stop.done


def test_a_rollout_keeps_a_batch_running_stops_at_need_groups_and_carries_the_rest():
    # response r of prompt i ends (EOS included) after lengths[i][r] tokens
    lengths = {0: [1, 9], 1: [2, 2], 2: [1, 1], 3: [12, 4], 4: [1, 1], 5: [2, 2], 6: [12, 12],
               7: [12, 12]}
    gen = LengthGenerator(lengths)
    drawn = []

    draw = drawer(drawn)

    pool = PartialRollouts(G, NEED, IN_FLIGHT, MAX_NEW)
    encode = lambda ex: [ex.i]  # noqa: E731
    prompts, samples, m = pool.rollout(gen, encode, draw, seed=0, step=0)
    # one draw (2 groups) fills the batch of 4 requests; after engine step 1 response 0/0 has
    # ended, so groups 2 and 3 join (the pool holds 4 groups at most); after step 2 groups 1
    # and 2 are complete and the rollout stops
    call = gen.calls[0]
    assert [tuple(p) for p in call["prompts"]] == [(0,), (0,), (1,), (1,), (2,), (2,), (3,), (3,)]
    assert call["budgets"] == [MAX_NEW] * 8 and call["need"] == NEED
    assert call["refills"] == [0, 4]
    assert [e.i for e in drawn] == [0, 1, 2, 3]
    assert [p.i for p in prompts] == [1, 2]
    assert [s.response_ids for s in samples] == [[10, EOS], [30, EOS], [EOS], [EOS]]
    assert m["rollout/partial_carried_share"] == 0.0 and m["rollout/partial_max_age"] == 0.0
    assert m["rollout/partial_in_flight"] == 2 and m["rollout/partial_generated_tokens"] == 11
    # step 1: the unfinished responses (0's second after 2 tokens, 3's two after 1) go first,
    # each from its prompt + the tokens written, with what is left of its budget; 3 requests
    # run, so one draw (groups 4, 5) joins before the call
    prompts, samples, m = pool.rollout(gen, encode, draw, seed=1, step=1)
    call = gen.calls[1]
    assert list(zip(map(tuple, call["prompts"]), call["budgets"])) == [
        ((0, 30, 31), MAX_NEW - 2), ((3, 10), MAX_NEW - 1), ((3, 30), MAX_NEW - 1),
        ((4,), MAX_NEW), ((4,), MAX_NEW), ((5,), MAX_NEW), ((5,), MAX_NEW)]
    assert call["need"] == NEED  # no group was complete before the call
    # group 4 ends at engine step 1, group 5 at step 2; groups drawn first go first
    assert [p.i for p in prompts] == [4, 5] and m["rollout/partial_max_age"] == 0
    # step 2 (groups 6 and 7 join, longer): group 3's second response ends after 1 more token
    # (4 in all), group 0's after 5 more (9), group 3's first after 9 more (12): groups 0 and 3
    prompts, samples, m = pool.rollout(gen, encode, draw, seed=2, step=2)
    assert [e.i for e in drawn] == list(range(8))
    assert [p.i for p in prompts] == [0, 3]
    assert [s.response_ids for s in samples] == [
        [EOS], [30, 31, 32, 33, 34, 35, 36, 37, EOS],
        [10 + k for k in range(11)] + [EOS], [30, 31, 32, EOS]]
    assert [s.response_logprobs for s in samples] == [[-0.5] * len(s.response_ids)
                                                       for s in samples]
    assert m["rollout/partial_carried_share"] == 1.0 and m["rollout/partial_max_age"] == 2


def test_the_engine_is_called_even_when_the_groups_needed_are_already_complete():
    """Under expert parallelism a rollout call is collective: a rank whose pool already holds
    the groups it needs (more completed in one step than it took) still calls the engine, with
    a stop that is done before any step (its fresh requests written nothing, kept for the next
    call), so every rank makes the same calls."""
    # groups 0 and 1 end at engine step 2; groups 2 and 3 join after step 1 and end at step 2
    lengths = {0: [1, 2], 1: [2, 2], 2: [1, 1], 3: [1, 1], 4: [3, 3], 5: [3, 3]}
    gen, drawn = LengthGenerator(lengths), []
    pool = PartialRollouts(G, NEED, IN_FLIGHT, MAX_NEW)
    encode = lambda ex: [ex.i]  # noqa: E731
    prompts, _, _ = pool.rollout(gen, encode, drawer(drawn), seed=0, step=0)
    assert [p.i for p in prompts] == [0, 1]
    prompts, samples, m = pool.rollout(gen, encode, drawer(drawn), seed=1, step=1)
    assert len(gen.calls) == 2 and gen.calls[1]["need"] == 0  # called, its stop already done
    assert [tuple(p) for p in gen.calls[1]["prompts"]] == [(4,), (4,), (5,), (5,)]
    assert [p.i for p in prompts] == [2, 3] and m["rollout/partial_generated_tokens"] == 0
    prompts, samples, _ = pool.rollout(gen, encode, drawer(drawn), seed=2, step=2)
    assert [p.i for p in prompts] == [4, 5]
    assert [s.response_ids for s in samples] == [[10, 11, EOS], [30, 31, EOS]] * 2


def test_oldest_complete_groups_first_and_resume_from_state_is_identical():
    rng = random.Random(3)
    lengths = {i: [rng.randint(1, MAX_NEW)] * G for i in range(200)}

    def run(pool, gen, drawn, steps, start=0):
        out = []

        draw = drawer(drawn)
        for step in range(start, start + steps):
            prompts, samples, m = pool.rollout(gen, lambda e: [e.i], draw, seed=step, step=step)
            out.append(([p.i for p in prompts], [(s.response_ids, s.finish_reason)
                                                 for s in samples], m))
        return out

    drawn_a = []
    a = run(PartialRollouts(G, NEED, IN_FLIGHT, MAX_NEW), LengthGenerator(lengths), drawn_a, 12)
    for ids, samples, m in a:
        assert len(ids) == NEED and len(samples) == NEED * G
        for (tokens, reason), i in zip(samples, [i for i in ids for _ in range(G)]):
            # every response is whole: its scripted length, whatever steps it spanned
            assert reason == "eos" and len(tokens) in lengths[i]
            assert tokens[:-1] in ([10 + 20 * r + k for k in range(len(tokens) - 1)]
                                   for r in range(G))
    assert any(m["rollout/partial_carried_share"] > 0 for *_, m in a)
    # resumed after step 5 from the state dict: the same later steps
    pool, drawn_b = PartialRollouts(G, NEED, IN_FLIGHT, MAX_NEW), []
    gen = LengthGenerator(lengths)
    run(pool, gen, drawn_b, 6)
    state = pool.state_dict()
    restored = PartialRollouts(G, NEED, IN_FLIGHT, MAX_NEW)
    restored.load_state_dict(state)
    b = run(restored, LengthGenerator(lengths), drawn_b, 6, start=6)
    assert b == a[6:]


@pytest.mark.parametrize("keep_kv", [False, True])
def test_keep_kv_continues_held_requests_but_after_a_checkpoint(keep_kv):
    """``rollout.partial_keep_kv``: every rollout asks the engine to hold what it cuts, and to
    continue what it holds, except the first rollout after a checkpoint (saved or loaded), so
    that a resumed run and the uninterrupted one both prefill the prefixes there."""
    lengths = {i: [MAX_NEW, 1] for i in range(200)}  # every group has a long response
    pool, gen, drawn = PartialRollouts(G, NEED, IN_FLIGHT, MAX_NEW, keep_kv=keep_kv), \
        LengthGenerator(lengths), []

    draw = drawer(drawn)

    def step(k):
        pool.rollout(gen, lambda e: [e.i], draw, seed=k, step=k)
        return gen.calls[-1]["held"]
    flags = [step(0), step(1)]
    pool.checkpoint_state()
    flags += [step(2), step(3)]
    pool.load_state_dict(pool.state_dict())
    flags += [step(4)]
    assert flags == [(keep_kv, False), (keep_kv, keep_kv), (keep_kv, False), (keep_kv, keep_kv),
                     (keep_kv, False)]


def test_a_rollout_rank_pool_prefills_after_the_trainers_checkpoints():
    """A rollout rank's pool (the trainer checkpoints the state it sends): after
    ``mark_checkpoint`` the next rollout does not continue held requests, the others do; a
    continued request is named by the id the engine held it under, whatever its tokens."""
    lengths = {i: [MAX_NEW, 1] for i in range(200)}
    pool, gen, drawn = PartialRollouts(G, NEED, IN_FLIGHT, MAX_NEW, keep_kv=True), \
        LengthGenerator(lengths), []
    flags = []
    for step in range(7):
        if step % 3 == 0:
            pool.mark_checkpoint()
        held_before = {r.held for g in pool.groups for r in g.responses if r.held is not None}
        pool.rollout(gen, lambda e: [e.i], drawer(drawn), seed=step, step=step)
        call = gen.calls[-1]
        flags.append(call["held"][1])
        if call["held"][1]:  # every held request continued, each at its own prompt
            assert sorted(call["continue_ids"].values()) == sorted(held_before)
            for i, rid in call["continue_ids"].items():
                assert len(call["prompts"][i]) > 1  # a prefix with written tokens
    assert flags == [False, True, True, False, True, True, False]


def test_in_flight_below_need_is_refused():
    with pytest.raises(ValueError, match="in_flight"):
        PartialRollouts(G, 4, 3, MAX_NEW)


@pytest.mark.parametrize("max_age", [1, 2])
def test_max_age_bounds_how_many_steps_a_response_spans(max_age):
    """``rollout.partial_max_age``: a rollout does not stop before every group drawn
    ``max_age`` steps ago is complete, so no trained response was written over more than
    ``max_age + 1`` steps; without it, the same long-tailed lengths carry responses further."""
    rng = random.Random(5)
    lengths = {i: [rng.choice([1, 1, 2, 3, MAX_NEW])] * G for i in range(400)}

    def ages(cap):
        pool, gen, drawn = PartialRollouts(G, NEED, IN_FLIGHT, MAX_NEW, max_age=cap), \
            LengthGenerator(lengths), []

        draw = drawer(drawn)
        out = []
        for step in range(30):
            _, samples, m = pool.rollout(gen, lambda e: [e.i], draw, seed=step, step=step)
            assert all(s.finish_reason in ("eos", "length") for s in samples)
            out.append(m["rollout/partial_max_span"])
        return out

    assert max(ages(max_age)) <= max_age + 1
    assert max(ages(0)) > max_age + 1
