"""Zero mismatch end to end (``precision.batch_invariant``): on every step of short tiny-model runs,
the rollout's log-probs are bitwise the trainer's old-policy pass (``mismatch/tokens_differ`` 0,
``kl/rollout_vs_train`` exactly 0.0) and the rollout's routes are the trainer's in every MoE layer
(``routing/rollout/*``); the same runs with the mode off differ. Packed training (the default)
and padded rows, fp32 and Megatron's bf16 path on CPU, EP = DP = 2 on two ranks."""

import pytest

from gspo_megatron.metrics import read_metrics
from tests.e2e.test_train_e2e import BF16_CLI, CLI, PADDED, gspo_train

pytestmark = pytest.mark.slow

ON = ["--precision.batch_invariant=true", "--routing.diagnostics=true",
      "--routing.replay_gap=false", "--trainer.eval_interval=0"]


def run_metrics(run_dir, *overrides, nproc=1, cli=CLI):
    gspo_train(run_dir, "--trainer.steps=3", *overrides, nproc=nproc, cli=cli)
    return [m for m in read_metrics(run_dir / "metrics.jsonl") if "kl/rollout_vs_train" in m]


def assert_zero_mismatch(metrics):
    assert len(metrics) == 3
    for m in metrics:
        assert m["mismatch/tokens_differ"] == 0.0, m
        assert m["kl/rollout_vs_train"] == 0.0, m
        assert m["response/num_tokens"] > 0
        # every MoE layer's rollout routes are the trainer's old-pass routes
        rates = {k: v for k, v in m.items() if k.startswith("routing/rollout/change_rate")}
        assert rates and all(v == 0.0 for v in rates.values()), rates


@pytest.fixture(scope="module")
def fp32_on(tmp_path_factory):
    """The fp32 run with the mode on (packed training, free routing): shared by two tests."""
    return run_metrics(tmp_path_factory.mktemp("zero") / "on", *ON)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero_mismatch_every_step(tmp_path, precision, request):
    """Packed training, then padded rows (fp32); the mode off beside it: its tokens differ."""
    cli = BF16_CLI if precision == "bf16" else CLI
    extra = ["--precision.bf16=true"] if precision == "bf16" else []
    on = (request.getfixturevalue("fp32_on") if precision == "fp32"
          else run_metrics(tmp_path / "on", *ON, *extra, cli=cli))
    assert_zero_mismatch(on)
    off = run_metrics(tmp_path / "off", "--trainer.eval_interval=0", *extra, cli=cli)
    print(f"MEASURED {precision} mode off: tokens_differ "
          f"{[m['mismatch/tokens_differ'] for m in off]} of "
          f"{[m['response/num_tokens'] for m in off]}, "
          f"kl {[m['kl/rollout_vs_train'] for m in off]}")
    assert sum(m["mismatch/tokens_differ"] for m in off) > 0
    if precision == "fp32":
        assert_zero_mismatch(run_metrics(tmp_path / "padded", *ON, *PADDED))


def test_r3_changes_nothing_at_the_first_update(tmp_path, fp32_on):
    """With zero mismatch the rollout's routes are the ones the trainer's forward takes anyway,
    so replaying them (R3) leaves the first update bitwise unchanged."""
    free = fp32_on
    r3 = run_metrics(tmp_path / "r3", *ON, "--routing.replay=r3")
    for key in ("loss/policy", "optim/grad_norm", "clip/fraction", "kl/rollout_vs_train"):
        assert free[0][key] == r3[0][key], key


@pytest.mark.distributed
def test_zero_mismatch_expert_and_data_parallel(tmp_path):
    """EP = 2 on two ranks (so DP = 2 too), packed, the experts replicated for decoding."""
    assert_zero_mismatch(run_metrics(tmp_path / "ep2", *ON,
                                     "--parallel.expert_model_parallel_size=2",
                                     "--rollout.decode_experts=replicated", nproc=2))


def test_partial_rollouts_count_the_older_weights_tokens_apart(tmp_path):
    """Partial rollouts: the tokens the step's own weights sampled differ in none; the carried
    prefixes, sampled by older weights, are counted apart (and are where the KL comes from)."""
    metrics = run_metrics(tmp_path / "partial", *ON, "--rollout.partial_rollouts=true",
                          "--trainer.steps=4")
    assert all(m["mismatch/tokens_differ"] == 0.0 for m in metrics)
    carried = [m for m in metrics if m["rollout/partial_carried_share"] > 0]
    assert carried and all(m["mismatch/tokens_differ_stale"] > 0 for m in carried)
    assert all(m["kl/rollout_vs_train"] == 0.0 for m in metrics if m not in carried)
