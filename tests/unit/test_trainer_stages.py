"""The trainer's stages and :meth:`Trainer.fit` against a fake :class:`Policy` and generator: the
loop's own logic (ordering, alignment, minibatching, fault skipping, resume) without Megatron."""

import contextlib
import json

import pytest
import torch

from gspo_megatron.config import TrainConfig
from gspo_megatron.data import PromptExample, PromptSampler
from gspo_megatron.faults import FaultInjector
from gspo_megatron.policy import RolloutSample
from gspo_megatron.stages import advantage_stage, batch_stage, rollout_stage, update_stage
from gspo_megatron.trainer import REQUEUE_EXIT_CODE, Task, Trainer


class CharTokenizer:
    """Token id = ord(char) - 40; 0 pad, 1 eos."""

    pad_id, eos_id, vocab_size = 0, 1, 100

    def apply_chat_template(self, text):
        return text

    def encode(self, text):
        return [ord(c) - 40 for c in text]

    def decode(self, ids):
        return "".join(chr(i + 40) for i in ids if i > 1)


class EchoGenerator:
    """Answers each prompt with its last character (right for 'x=x', wrong otherwise), seeded."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, seed):
        self.calls.append((len(prompts), seed))
        return [RolloutSample(list(p), [p[-1], 1], [-0.5, -0.1], "eos") for p in prompts]

    def with_sampling(self, config):
        return self


class FakePolicy:
    """Records what the loop asks; 'weights' are a counter of applied optimizer steps."""

    routing = None  # a dense model: no MoE routing

    def __init__(self, nonfinite_at=()):
        self.batches, self.steps, self.zeroed, self.saved = [], 0, 0, {}
        self.nonfinite_at = set(nonfinite_at)
        self.away, self.offloads = False, 0  # trainer.offload: the state is off the device

    @contextlib.contextmanager
    def training_state_offloaded(self):
        assert not self.away
        self.away, self.offloads = True, self.offloads + 1
        try:
            yield 0
        finally:
            self.away = False

    def logprobs(self, batch, *, temperature=1.0, routing=None):
        assert not self.away  # no pass runs while the training state is off the device
        return torch.full(batch.tokens.shape, -0.5)

    def train_minibatch(self, batch, objective, *, routing=None):
        assert not self.away
        self.batches.append(batch)
        bad = len(self.batches) - 1 in self.nonfinite_at
        return {"loss/policy": float(len(self.batches)), "faults/nonfinite_loss": float(bad)}

    def zero_grad(self):
        assert not self.away
        self.zeroed += 1

    def optimizer_step(self, corrupt_grad=None):
        assert not self.away
        grad = corrupt_grad(torch.ones(2)) if corrupt_grad else torch.ones(2)
        if not torch.isfinite(grad).all():
            return False, float("nan")
        self.steps += 1
        return True, 1.0

    lr = 0.1

    def has_checkpoint(self, d):
        return d in self.saved

    def save_checkpoint(self, d, step, extra, keep_last, before_commit=None, background=False):
        # A background save holds the state of now and becomes loadable only once committed.
        self.pending = (d, (step, json.loads(json.dumps(extra)), self.steps))
        if not background:
            self.wait_for_checkpoint()

    def wait_for_checkpoint(self):
        if getattr(self, "pending", None) is not None:
            d, state = self.pending
            self.saved[d], self.pending = state, None
        return 0.0

    def abort_checkpoint(self):
        self.pending = None

    def load_checkpoint(self, d, allow_pickle=False):
        step, extra, self.steps = self.saved[d]
        return step, extra

    def save_weights(self, d):
        pass


def _prompts(n):
    return [PromptExample(prompt=f"{chr(50 + i % 40)}={chr(50 + i % 40)}", answer=chr(50 + i % 40),
                          index=i) for i in range(n)]


def _cfg(tmp_path, **trainer):
    cfg = TrainConfig()
    cfg.rollout.group_size, cfg.rollout.prompts_per_step = 2, 4
    cfg.trainer.num_minibatches, cfg.trainer.micro_batch_size = 2, 2
    cfg.trainer.eval_interval = 0
    for k, v in trainer.items():
        setattr(cfg.trainer, k, v)
    cfg.logging.run_dir, cfg.logging.progress = str(tmp_path), False
    return cfg


def test_rollout_is_prompt_major():
    gen = EchoGenerator()
    samples = rollout_stage(gen, CharTokenizer(), _prompts(3), group_size=2, seed=7)
    assert gen.calls == [(6, 7)]
    assert [s.prompt_ids for s in samples][::2] == [s.prompt_ids for s in samples][1::2]


def test_batch_aligns_rollout_logprobs_with_labels():
    samples = [RolloutSample([5, 6, 7], [8, 1], [-0.25, -0.5], "eos"),
               RolloutSample([5], [9, 9, 1], [-1.0, -2.0, -3.0], "eos")]

    def pack(seqs, plens):
        from gspo_megatron.policy import make_policy_batch
        return make_policy_batch(seqs, plens, pad_id=0)

    batch = batch_stage(samples, torch.tensor([1.0, -1.0]), pack)
    # label t predicts token t+1: response token j of a prompt of length p is label p - 1 + j
    assert batch.labels[0, 2:4].tolist() == [8, 1] and batch.labels[1, 0:3].tolist() == [9, 9, 1]
    assert batch.rollout_logprobs[batch.response_mask].tolist() == [-0.25, -0.5, -1.0, -2.0, -3.0]
    assert batch.advantages.tolist() == [1.0, -1.0]


def test_rollout_logprobs_of_the_wrong_count_per_sequence_are_refused():
    """Per-sequence value counts that are wrong but add up to the batch's response tokens (here
    2 + 1 for spans of 1 and 2) would shift values between sequences in the one masked write;
    c24cbcc placed them silently. Refused, naming the sequence."""
    from gspo_megatron.layout import TokenLayout

    layout = TokenLayout(torch.tensor([4, 5]), torch.tensor([3, 3]), 6)  # spans of 1 and 2
    assert layout.response_mask().sum(1).tolist() == [1, 2]
    with pytest.raises(ValueError, match="sequence 0 has 2 values for its 1 response tokens"):
        layout.place_labels([[-0.1, -0.2], [-0.3]])
    placed = layout.place_labels([[-0.1], [-0.2, -0.3]])
    assert placed[layout.response_mask()].tolist() == pytest.approx([-0.1, -0.2, -0.3])


@pytest.mark.parametrize("multiple, seq_length", [(1, None), (4, None), (1, 40), (8, 40)])
def test_whole_batch_packing_equals_per_sequence_writes(multiple, seq_length):
    """make_policy_batch and TokenLayout build the batch with whole-batch tensor ops; they equal
    per-sequence writes through the layout's spans exactly, empty prompts and empty responses
    included, and the rollout log-probs' one masked write (place_labels) equals per-sample
    writes."""
    import random

    from gspo_megatron.policy import make_policy_batch

    rng = random.Random(multiple * 100 + (seq_length or 0))
    plens = [rng.randint(0, 6) for _ in range(37)] + [0, 3]
    seqs = [[rng.randrange(2, 50) for _ in range(p + rng.randint(0 if p else 1, 20))]
            for p in plens[:-2]] + [[7], [4, 5, 6]]  # an empty-prompt and an empty response
    batch = make_policy_batch(seqs, plens, 1, multiple, seq_length)
    layout = batch.layout
    tokens = torch.full((layout.num_rows, layout.seq_length), 1, dtype=torch.long)
    mask = torch.zeros(layout.num_rows, layout.seq_length, dtype=torch.bool)
    for i, seq in enumerate(seqs):
        row, span = layout.token_span(i)
        tokens[row, span] = torch.tensor(seq)
        row, span = layout.label_span(i)
        mask[row, span] = True
    assert torch.equal(batch.tokens, tokens) and torch.equal(batch.response_mask, mask)
    assert torch.equal(batch.labels[:, :-1], tokens[:, 1:]) and bool((batch.labels[:, -1] == 1).all())
    samples = [RolloutSample(s[:p], s[p:], [rng.uniform(-5, 0) for _ in s[p:]], "eos")
               for s, p in zip(seqs, plens) if p > 0]
    fast = batch_stage(samples, torch.zeros(len(samples)),
                       lambda q, pl: make_policy_batch(q, pl, 1, multiple, seq_length))
    slow = torch.zeros(fast.tokens.shape)
    for i, smp in enumerate(samples):
        row, labels = fast.layout.label_span(i)
        slow[row, labels] = torch.tensor(smp.response_logprobs)
    assert torch.equal(fast.rollout_logprobs, slow) and fast.rollout_logprobs.abs().sum() > 0


def test_advantages_are_group_normalised():
    adv, m, tied = advantage_stage(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, normalize_std=True)
    assert adv[2:].tolist() == [0.0, 0.0] and adv[0] > 0 > adv[1]
    assert tied.tolist() == [False, True]  # the second group's rewards tie
    assert m["reward/zero_variance_group_fraction"] == 0.5 and m["reward/zero_variance_groups"] == 1


def test_update_uses_every_row_once_in_num_minibatches(tmp_path):
    cfg = _cfg(tmp_path, num_minibatches=4)
    policy = FakePolicy()
    from gspo_megatron.policy import make_policy_batch
    batch = make_policy_batch([[i + 2, i + 3] for i in range(8)], [1] * 8, pad_id=0)
    batch.advantages, batch.old_logprobs = torch.arange(8.0), torch.zeros(8, 2)
    out = update_stage(policy, batch, cfg, seed=3)
    assert len(policy.batches) == 4 and policy.zeroed == 4 and policy.steps == 4
    rows = sorted(int(a) for b in policy.batches for a in b.advantages)
    assert rows == list(range(8))  # a permutation: every row exactly once
    assert out["loss/policy"] == pytest.approx(2.5) and out["optim/lr"] == 0.1
    again = FakePolicy()
    update_stage(again, batch, cfg, seed=3)  # same seed, same order (every rank agrees)
    assert [b.advantages.tolist() for b in again.batches] == [b.advantages.tolist() for b in policy.batches]


def test_update_skips_the_step_of_a_nonfinite_minibatch(tmp_path):
    cfg = _cfg(tmp_path)
    from gspo_megatron.policy import make_policy_batch
    batch = make_policy_batch([[2, 3]] * 8, [1] * 8, pad_id=0)
    batch.advantages, batch.old_logprobs = torch.ones(8), torch.zeros(8, 2)
    policy = FakePolicy(nonfinite_at={1})
    out = update_stage(policy, batch, cfg, seed=0)
    assert policy.steps == 1 and out["faults/skipped_updates"] == 0.5
    assert out["optim/grad_norm_max"] == 1.0  # the applied step's norm (the skipped one is NaN)
    faults = FaultInjector("nan_grads:5")
    faults.step = 5
    policy = FakePolicy()
    out = update_stage(policy, batch, cfg, seed=0, step=5, faults=faults)
    assert policy.steps == 0 and out["optim/skipped"] == 1.0
    assert out["optim/grad_norm_max"] != out["optim/grad_norm_max"]  # NaN: nothing applied


def test_grad_norm_max_shows_a_one_minibatch_spike(tmp_path):
    """``optim/grad_norm`` averages a step's optimiser steps; ``optim/grad_norm_max`` is the
    largest, so a spike in one minibatch stays visible (issue 34: 174 vs ~1.7)."""
    cfg = _cfg(tmp_path, num_minibatches=4)
    from gspo_megatron.policy import make_policy_batch
    batch = make_policy_batch([[2, 3]] * 8, [1] * 8, pad_id=0)
    batch.advantages, batch.old_logprobs = torch.ones(8), torch.zeros(8, 2)

    class Spiky(FakePolicy):
        def optimizer_step(self, corrupt_grad=None):
            self.steps += 1
            return True, 100.0 if self.steps == 2 else 1.0

    out = update_stage(Spiky(), batch, cfg, seed=0)
    assert out["optim/grad_norm_max"] == 100.0 and out["optim/grad_norm"] == pytest.approx(25.75)


def _trainer(cfg, policy, faults=None):
    train = _prompts(16)
    sampler = PromptSampler(train, cfg.rollout.prompts_per_step, seed=cfg.trainer.seed)
    from gspo_megatron.rewards import get_reward_fn
    task = Task(CharTokenizer(), sampler, train, _prompts(4), get_reward_fn("arithmetic_exact"))
    return Trainer(cfg, _Groups(), policy, EchoGenerator(), task, faults=faults)


class _Groups:
    world_size, rank, dp_rank, dp_size, pp_size, tp_size = 1, 0, 0, 1, 1, 1
    dp_group = None
    is_logging_rank = True


def test_fit_trains_saves_and_resumes_exactly(tmp_path):
    cfg = _cfg(tmp_path, steps=3)
    policy = FakePolicy()
    summary = _trainer(cfg, policy).fit()
    assert summary["steps"] == 3 and summary["exit_code"] == 0
    assert summary["accuracy_before"] == summary["accuracy_after"] == 1.0
    metrics = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert policy.steps == 3 * cfg.trainer.num_minibatches
    # Every rollout (3 steps, the evaluations before and after) ran with the training state
    # offloaded (a no-op without trainer.offload); no pass or step ran meanwhile (FakePolicy).
    assert policy.offloads == 3 + 2 and not policy.away
    # A longer run resumes from the checkpoint at step 3: same data position, no redone steps.
    cfg5 = _cfg(tmp_path, steps=5)
    resumed = _trainer(cfg5, policy)
    summary = resumed.fit()
    assert summary["start_step"] == 3 and summary["steps"] == 5
    straight_policy = FakePolicy()
    straight = _trainer(_cfg(tmp_path / "b", steps=5), straight_policy)
    straight.fit()
    assert resumed.task.sampler.state_dict() == straight.task.sampler.state_dict()
    assert policy.steps == straight_policy.steps == 5 * cfg.trainer.num_minibatches
    assert [m["step"] for m in (json.loads(x) for x in open(tmp_path / "metrics.jsonl"))] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGUSR1"])
def test_a_stop_signal_ends_the_fit_and_the_callers_handlers_come_back(tmp_path, stop):
    """SIGTERM or SIGUSR1 during a step: the run checkpoints and exits for requeue (the e2e test
    sends SIGTERM to a real gspo-train); when fit returns, the handlers installed before it are
    the process's again (an in-process run used to leave its own, so a SIGTERM to pytest logged
    "will checkpoint after this step" and went on)."""
    import os
    import signal

    seen = []

    def mine(signum, frame):
        seen.append(signum)

    signals = (signal.SIGTERM, signal.SIGUSR1)
    before = {sig: signal.signal(sig, mine) for sig in signals}
    try:
        class Terminated(FakePolicy):
            def optimizer_step(self, corrupt_grad=None):
                if self.steps == 0:
                    os.kill(os.getpid(), getattr(signal, stop))  # to the trainer's handler
                return super().optimizer_step(corrupt_grad)

        cfg = _cfg(tmp_path, steps=3)
        summary = _trainer(cfg, Terminated()).fit()
        assert summary["exit_code"] == REQUEUE_EXIT_CODE and summary["steps"] == 1 and not seen
        assert all(signal.getsignal(sig) is mine for sig in signals)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


@pytest.mark.parametrize("source", ["recompute", "rollout"])
def test_old_logprobs_come_from_the_configured_source(tmp_path, source):
    """``trainer.old_logprobs``: ``recompute`` (the default) trains against the policy's own
    old-log-prob pass, ``rollout`` against the engine's log-probs. The two differ here (policy
    -0.75 everywhere, engine -0.5 / -0.1), so the minibatches show which one the objective got;
    with them swapped the rollout correction would silently compare the engine with itself."""

    class Scoring(FakePolicy):
        def logprobs(self, batch, *, temperature=1.0, routing=None):
            return torch.full(batch.tokens.shape, -0.75)

    cfg = _cfg(tmp_path, steps=1, old_logprobs=source)
    policy = Scoring()
    _trainer(cfg, policy).rl_step()
    for mb in policy.batches:
        got = mb.old_logprobs[mb.response_mask]
        expected = (mb.rollout_logprobs[mb.response_mask] if source == "rollout"
                    else torch.full_like(got, -0.75))
        assert torch.equal(got, expected), (source, got, expected)
        assert not torch.equal(mb.rollout_logprobs[mb.response_mask], torch.full_like(got, -0.75))
