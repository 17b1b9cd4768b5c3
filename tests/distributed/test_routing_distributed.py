"""Routing replay (R2) and routing diagnostics under TP=2 + sequence parallel, EP=2 and PP=2 (1F1B,
also with full activation recompute) on gloo, against a single process with the same weights.

Each layout: replaying the routes recorded in an eval forward gives bit-identical logits in a
training forward; after perturbing the routers, replay still forces exactly the recorded routes
(in the forward and in the backward's recompute) and the routers get a gradient; the diagnostics
report a change rate of 0 before the perturbation and the single process's value after it; the
free drift metrics' routes from a training forward (recorded, or captured under replay) match too.
"""

import json
import os

import pytest

from tests.helpers.torchrun import torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = os.path.join(os.path.dirname(__file__), "routing_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(nproc, *args, timeout=240):
    return torchrun(nproc, WORKER, *args, timeout=timeout)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    base = tmp_path_factory.mktemp("routing")
    weights = str(base / "weights")
    run(1, "--weights", weights, "--make-reference")
    out = base / "single.json"
    run(1, "--weights", weights, "--out", str(out))
    return base, weights, json.loads(out.read_text())[0]


LAYOUTS = {
    "tp2_sp": ["--tp", "2"],
    "ep2": ["--ep", "2"],
    "pp2": ["--pp", "2"],
    "pp2_full_recompute": ["--pp", "2", "--recompute", "full"],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_replay_and_diagnostics_match_single_process(single, name):
    base, weights, ref = single
    assert ref["exact"] and ref["routes_forced"] and ref["moe_layers"] == [0, 1, 2]
    assert ref["diag_same"]["routing/change_rate"] == 0.0
    assert ref["diag_perturbed"]["routing/change_rate"] > 0.05
    out = base / f"{name}.json"
    run(2, "--weights", weights, "--out", str(out), *LAYOUTS[name])
    ranks = json.loads(out.read_text())
    for r in ranks:
        assert r["routes_forced"], (name, r["rank"])
        assert r["free_changed_positions"] > 0, "the perturbation should move routes"
        assert all(g > 0 for g in r["router_grad_abs_sum"]), (name, r)
        if "exact" in r:  # last pipeline stage holds the logits
            assert r["exact"], (name, r["rank"])
        assert r["diag_same"]["routing/change_rate"] == 0.0
        assert r["diag_same"]["routing/jaccard"] == 1.0
        # the same weights, batch and perturbation: the same routes as one process (up to a
        # near-tie flipping under a different reduction order)
        for key in ("routing/change_rate", "routing/jaccard"):
            assert r["diag_perturbed"][key] == pytest.approx(ref["diag_perturbed"][key], abs=0.01), key
        # drift from a training forward: the free routes are the diagnostics' (same weights)
        assert r["drift_free"] == pytest.approx(r["diag_perturbed"]["routing/change_rate"], abs=1e-12)
        assert r["drift_free"] == pytest.approx(ref["drift_free"], abs=0.01)
        assert 0 < r["drift_replay"] == pytest.approx(ref["drift_replay"], abs=0.01)
        if "routing/replay_gap_k3" in r["diag_perturbed"]:
            assert r["diag_same"]["routing/replay_gap_k3"] == 0.0
            assert r["diag_perturbed"]["routing/replay_gap_k3"] > 0
    if name == "tp2_sp":  # each TP rank records only its sequence shard
        assert ranks[0]["store_shape"] == [3, 8, 16, 2]
    if name.startswith("pp2"):  # MoE layers are numbered over MoE layers only, across stages
        assert ranks[0]["moe_layers"] == [0] and ranks[1]["moe_layers"] == [1, 2]
    if name == "ep2":  # EP ranks are data-parallel for the router: 4 sequences each
        assert ranks[0]["store_shape"] == [3, 4, 32, 2]


def test_gspo_train_with_r2_and_diagnostics_logs_routing_metrics(tmp_path):
    """The trainer wiring: R2 replay and the routing/* metrics in a real (tiny) gspo-train run,
    with the diagnostics on every second step (``routing.diagnostics_interval``)."""
    from tests.e2e.test_train_e2e import gspo_train

    from gspo_megatron.metrics import read_metrics

    gspo_train(tmp_path, "--trainer.steps=3", "--routing.replay=r2", "--routing.diagnostics=true",
               "--routing.diagnostics_interval=2", "--optim.lr=1e-3")
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    # Step 1 runs no diagnostics, but the free drift metrics come from the update forwards and the
    # rollout-vs-trainer ones from the old-policy pass (every step).
    diag_keys = [k for k in rows[1] if k.startswith("routing/")
                 and not k.startswith(("routing/drift/", "routing/rollout/"))]
    for r in rows:  # fp32 engine and trainer, same weights: the same routes
        assert r["routing/rollout/change_rate"] <= 0.01 and "routing/rollout/change_rate/layer_1" in r
    assert not diag_keys and "perf/routing_diagnostics_s" not in rows[1]
    for r in rows:
        # minibatch 0 trains on-policy: its free routes are the old pass's (up to near-ties that
        # a different GEMM batch size can flip); minibatch 1 runs after one update.
        assert r["routing/drift/after_0_updates"] <= 0.01
        assert 0.0 <= r["routing/drift/change_rate"] <= 1.0 and "routing/drift/after_1_updates" in r
        assert "routing/drift/change_rate/layer_1" in r
    for r in (rows[0], rows[2]):
        assert 0.0 <= r["routing/change_rate"] <= 1.0
        assert 0.0 <= r["routing/change_rate/layer_0"] <= 1.0 and "routing/change_rate/layer_1" in r
        assert 0.0 <= r["routing/jaccard"] <= 1.0 and r["routing/load_imbalance"] >= 1.0
        assert r["routing/replay_gap_k3"] >= 0.0 and r["perf/routing_diagnostics_s"] > 0
        assert "routing/change_rate/after_update_1" in r  # two minibatches per step
