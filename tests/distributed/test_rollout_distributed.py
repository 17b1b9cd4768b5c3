"""Megatron-Core rollouts are layout-invariant: TP=2 (+SP), EP=2 and PP=2 give, on every rank, the same
responses, finish reasons and log-probs (1e-5) as a single process with the same weights and seed.

Greedy and sampled (T=0.9, top-k 6) decoding on shared prompts; under EP=2 the two ranks also
generate *different* prompt sets (different counts and lengths) in the same call, which exercises
the lock-step padding with dummy forwards, compared with single-process runs of each set.
"""

import json
import os

import pytest

from tests.helpers.torchrun import torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = os.path.join(os.path.dirname(__file__), "rollout_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def run(nproc, *args, timeout=240):
    return torchrun(nproc, WORKER, *args, timeout=timeout)


def load(out, rank=0):
    with open(os.path.join(out, f"rank{rank}.json")) as f:
        return json.load(f)


def assert_same(got, ref, what):
    assert len(got) == len(ref), what
    for i, (g, r) in enumerate(zip(got, ref)):
        assert g["r"] == r["r"] and g["f"] == r["f"], (what, i, g, r)
        assert g["lp"] == pytest.approx(r["lp"], abs=1e-5), (what, i)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    base = tmp_path_factory.mktemp("rollout")
    weights = str(base / "weights")
    single = str(base / "single")
    run(1, "--weights", weights, "--make-reference", "--out", single)
    return base, weights, load(single)


@pytest.mark.parametrize("layout", [
    ["--tp", "2"], ["--ep", "2"], ["--pp", "2"],
    # the shipped Qwen3-30B-A3B recipes' rollout layout, halved (TP2 x EP8, ETP1 -> TP2 x EP2 on
    # 4 ranks: DP 2, each EP group = a TP pair)
    ["--tp", "2", "--ep", "2", "--etp", "1"],
    # the experts' own TP under EP: each EP rank's experts F-sharded over its TP pair
    ["--tp", "2", "--ep", "2", "--etp", "2"]],
    ids=["tp2_sp", "ep2", "pp2", "tp2_ep2_etp1", "tp2_ep2_etp2"])
def test_rollouts_match_single_process(reference, layout):
    base, weights, ref = reference
    out = str(base / "_".join(layout).strip("-"))
    nproc = 4 if len(layout) > 2 else 2
    run(nproc, "--weights", weights, "--out", out, *layout, timeout=400)
    finish = [s["f"] for k in ("greedy", "sampled") for s in ref[k]]
    assert "eos" in finish and "length" in finish, "the reference should exercise both endings"
    for rank in range(nproc):
        got = load(out, rank)
        assert got["sequence_parallel_restored"] and got["training_restored"], got
        for key in ("greedy", "sampled", "greedy_sharded", "greedy_megatron"):
            assert_same(got[key], ref[key], (layout, rank, key))
        for key in ("own_greedy", "own_sampled", "own_greedy_sharded", "own_greedy_megatron"):
            assert_same(got[key], ref[f"{key}_by_dp"][got["dp_rank"]], (layout, rank, key))
        # the step function on this layout's own module and collectives (TP: column / row shards
        # and their all-reduces), Megatron's forward only where asked (PP: not covered)
        assert got["own_greedy_fast"] == (layout[0] != "--pp"), (layout, rank)
        assert not got["own_greedy_megatron_fast"]
        assert [s["r"] for s in got["greedy"]] == [s["r"] for s in got["greedy_megatron"]]
        # EP: the decoding step's experts gathered on every rank (``auto``), or left sharded
        assert (got["own_greedy_replicated"], got["own_greedy_sharded_replicated"]) == (
            (True, False) if "--ep" in layout else (False, False)), (layout, rank)
    # the same prompts and seed on every rank: the same draws (TP peers share every collective)
    assert len({json.dumps(load(out, r)["sampled_rounds"]) for r in range(nproc)}) == 1
    if layout[0] == "--ep":  # EP=2 on 2 ranks is DP=2: the ranks really held different prompts
        assert load(out, 0)["dp_rank"] != load(out, 1)["dp_rank"]


@pytest.mark.parametrize("layout", [["--tp", "2"], ["--ep", "2"], ["--pp", "2"]],
                         ids=["tp2_sp", "ep2", "pp2"])
def test_r3_matches_single_process(reference, layout):
    """R3 under TP=2+SP, EP=2 and PP=2: every rank records the single process's routes for its
    own MoE layers, the old-policy pass replays them on its sequence shard (forced where
    recorded), and the replayed log-probs equal the single process's."""
    base, weights, ref = reference
    out = str(base / "_".join(layout).strip("-"))
    if not os.path.exists(os.path.join(out, "rank0.json")):
        run(2, "--weights", weights, "--out", out, *layout)
    single = ref["r3"]
    assert single["forced"] and single["max_gap"] < 1e-5
    assert single["metrics"]["routing/rollout/change_rate"] == 0.0
    for rank in (0, 1):
        got = load(out, rank)["r3"]
        assert got["forced"], (layout, rank)
        for g, r in zip(got["routes"], single["routes"]):
            assert g and all(g[layer] == r[layer] for layer in g), (layout, rank)
        assert got["metrics"]["routing/rollout/change_rate"] == 0.0, (layout, rank)
        if "lp" in got:
            assert got["max_gap"] < 1e-5
            for g, r in zip(got["lp"], single["lp"]):
                assert g == pytest.approx(r, abs=1e-5)
    if layout[0] == "--tp":  # sequence parallel: each TP rank holds half of the positions
        for rank in (0, 1):
            got = load(out, rank)["r3"]
            assert got["store_shape"][2] * 2 == got["seq_length"], got["store_shape"]
    if layout[0] == "--pp":  # each stage records and replays its own MoE layer
        assert [list(load(out, r)["r3"]["routes"][0]) for r in (0, 1)] == [["0"], ["1"]]
