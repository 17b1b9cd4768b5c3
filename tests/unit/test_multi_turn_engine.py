"""The turn loop on Megatron's dynamic engine (:mod:`gspo_megatron.envs.turns`) against a scripted
environment: the exact token sequence of every episode (policy turns, the environment's tokens
after each EOS), the KV cache kept across turns (every token forwarded once: no earlier turn is
prefilled again), the engine's log-probs of the policy tokens equal to the trainer's full
forward of the whole episode, and R3's routes of every forwarded token (environment tokens
included) equal to the trainer's own routes."""

from __future__ import annotations

import os

import pytest
import torch

from gspo_megatron.config import RolloutConfig
from gspo_megatron.config.model import ParallelConfig, PrecisionConfig, model_config_from_preset
from gspo_megatron.envs.turns import EPISODE_KEY, POLICY_MASK_KEY, Episodes, episode_rewards
from gspo_megatron.envs.workers import InProcessEnvs
from gspo_megatron.policy import make_policy_batch

pytestmark = pytest.mark.slow  # builds a Megatron model

VOCAB, EOS, PAD = 12, 2, 0
os.environ.setdefault("TQDM_DISABLE", "1")


class DigitTokenizer:
    """Digits 0-8 <-> ids 3-11; EOS 2. An environment message renders as its content."""

    eos_id, pad_id = EOS, PAD

    def encode(self, text):
        return [3 + int(c) for c in text if c.isdigit() and c != "9"]

    def decode(self, ids):
        return "".join(str(i - 3) for i in ids if i >= 3)

    def continuation(self, messages):
        return "".join(m["content"] for m in messages)

    def encode_prompt(self, prompt):
        return self.encode(prompt if isinstance(prompt, str) else prompt[-1]["content"])


class ScriptedEnv:
    """Answers turn ``t`` (1-based) with ``"8" * t + "0"`` until the third turn, which ends the
    episode with reward = the number of digits the policy wrote in its last turn."""

    def reset(self, example):
        self.turn = 0
        return [{"role": "user", "content": example.prompt}]

    def step(self, text):
        self.turn += 1
        if self.turn == 3:
            return [], float(len(text)), True
        return [{"role": "tool", "content": "8" * self.turn + "0"}], None, False


class Example:
    def __init__(self, prompt):
        self.prompt, self.model_input = prompt, prompt


@pytest.fixture(scope="module")
def setup():
    from gspo_megatron.backends.megatron.parallel import destroy_distributed, initialize_distributed
    from gspo_megatron.backends.megatron.policy import build_policy
    from gspo_megatron.config import OptimConfig

    model_cfg = model_config_from_preset("tiny", vocab_size=VOCAB, seq_length=128,
                                         moe_aux_loss_coeff=0.0)
    groups = initialize_distributed(ParallelConfig(), model_cfg, seed=4321)
    policy = build_policy(model_cfg, ParallelConfig(), PrecisionConfig(transformer_impl="local"),
                          OptimConfig(), groups, total_steps=1, with_optimizer=False,
                          vocab_size=VOCAB)
    yield policy, groups
    destroy_distributed()


@pytest.fixture(scope="module")
def episodes(setup):
    from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine

    policy, groups = setup
    engine = RolloutEngine(policy.model, groups, eos_id=EOS, pad_id=PAD, vocab_size=VOCAB,
                           config=RolloutConfig(max_new_tokens=80, max_batch_size=8),
                           record_routes=True)
    runner = InProcessEnvs(ScriptedEnv)
    eps = Episodes(runner, DigitTokenizer(), max_turns=4, max_turn_tokens=20,
                   max_message_chars=100)
    examples = [Example(p) for p in ("1234", "5", "678", "12", "3456", "7", "01", "2")]
    prompts, driver = eps.start(examples, budget=80)
    samples = engine.generate(prompts, seed=11, turns=driver)
    return engine, samples, driver, prompts


def split_turns(sample):
    """``[(author, tokens)]``: the response cut into runs of one author."""
    runs, mask = [], sample.extra[POLICY_MASK_KEY]
    for tok, a in zip(sample.response_ids, mask):
        if runs and runs[-1][0] == a:
            runs[-1][1].append(tok)
        else:
            runs.append((a, [tok]))
    return runs


def test_exact_token_sequences_of_every_episode(episodes):
    _, samples, driver, prompts = episodes
    multi = 0
    for s, prompt in zip(samples, prompts):
        assert s.prompt_ids == prompt
        ep = s.extra[EPISODE_KEY]
        runs = split_turns(s)
        policy_runs = [t for a, t in runs if a == 1]
        env_runs = [t for a, t in runs if a == 0]
        # every environment run is exactly the scripted answer of the turn before it
        assert env_runs == [DigitTokenizer().encode("8" * t + "0") for t in range(1, len(env_runs) + 1)]
        # every policy turn but a cut last one ends at EOS, and nothing follows an EOS but the env
        for turn in policy_runs[:-1]:
            assert turn[-1] == EOS and EOS not in turn[:-1]
        assert ep["turns"] == sum(t[-1] == EOS for t in policy_runs)
        if ep["end"] == "done":
            assert ep["turns"] == 3 and s.finish_reason == "eos"
            assert ep["reward"] == float(sum(t >= 3 for t in policy_runs[-1]))  # its digits
        else:
            assert ep["end"] in ("turn_budget_cut", "length") and s.finish_reason == "length"
            assert ep["reward"] == 0.0
        assert len(s.response_logprobs) == len(s.response_ids)
        assert all(lp == 0.0 for lp, a in zip(s.response_logprobs, s.extra[POLICY_MASK_KEY]) if a == 0)
        multi += ep["turns"] >= 2
    assert multi >= 3, [s.extra[EPISODE_KEY] for s in samples]
    assert any(s.extra[EPISODE_KEY]["end"] == "done" for s in samples)
    _, m = episode_rewards(samples)
    assert m["env/env_tokens"] > 0 and m["env/errors"] == 0 and m["env/turns"] > 1


def test_kv_kept_across_turns_every_token_forwarded_once(episodes):
    engine, samples, _, _ = episodes
    once = sum(len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples)
    assert engine.dynamic.tokens_forwarded == once
    # what re-prefilling every turn (prompt + the turns so far) would have forwarded
    again = sum(len(s.prompt_ids) + i for s in samples
                for i, a in enumerate(s.extra[POLICY_MASK_KEY]) if i and a == 1
                and s.extra[POLICY_MASK_KEY][i - 1] == 0)
    assert again > 0  # (so the count above tells the two apart)


def _batch(samples):
    batch = make_policy_batch([s.prompt_ids + s.response_ids for s in samples],
                              [len(s.prompt_ids) for s in samples], pad_id=PAD)
    batch.rollout_logprobs = batch.layout.place_labels([s.response_logprobs for s in samples])
    batch.response_mask &= batch.layout.place_labels(
        [s.extra[POLICY_MASK_KEY] for s in samples]) > 0
    return batch


def test_policy_logprobs_equal_the_trainers_full_forward(setup, episodes):
    """The engine's log-prob of every policy token (turns 2, 3 computed over the KV of the
    earlier turns and the environment's tokens) equals the trainer's one forward of the whole
    episode: the environment's tokens were in the cache at their positions."""
    policy, _ = setup
    _, samples, _, _ = episodes
    batch = _batch(samples)
    lp = policy.logprobs(batch)
    gap = (lp - batch.rollout_logprobs)[batch.response_mask].abs().max().item()
    assert gap < 1e-5, gap


def test_r3_routes_across_turns_equal_the_trainers(setup, episodes):
    """Routes recorded for every forwarded token (prompt, policy turns, environment tokens);
    with the trainer's weights equal to the sampler's, the trainer's routers pick the same
    experts at every one of them."""
    from gspo_megatron.backends.megatron.routing.rollout_routes import rollout_route_store
    from gspo_megatron.routing.stats import route_change

    policy, _ = setup
    _, samples, _, _ = episodes
    batch = _batch(samples)
    for s in samples:
        assert s.extra["routes"].shape[1] == len(s.prompt_ids) + len(s.response_ids) - 1
    store = rollout_route_store(samples, batch.layout, policy.model_routing)
    hooks = policy.model_routing.replayer(store, policy.micro_batch_size, capture_natural=True)
    policy.logprobs(batch, routing=hooks)
    natural = hooks.natural_store()
    changed, _ = route_change(store.indices, natural.indices, 4)  # (the tiny preset: 4 experts)
    # every forwarded position has a route: the environment's tokens (label positions where
    # the layout has a response token the policy did not write) among them
    forwarded = torch.tensor([len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples])
    assert torch.equal(store.known.sum(1), forwarded)
    env_positions = batch.layout.response_mask() & ~batch.response_mask
    assert int(env_positions.sum()) > 0 and bool(store.known[env_positions].all())
    assert int(changed[:, store.known].sum()) == 0
