"""The update path's fast paths against Megatron's own: the lean step (norm and clipping with
foreach ops) is bitwise Megatron's ``optimizer.step()``, torch's fused AdamW inside Megatron's
optimizer follows its default per-parameter loop on CPU to float32 rounding, the non-finite
check reads DDP's flat gradient buffers with the same answer as the per-parameter check, the
single-rank ``finalize_model_grads`` leaves the gradients as Megatron's does, and the eval/train
switch of the log-prob pass sets every module's flag as ``nn.Module.train`` does."""

import pytest
import torch

from gspo_megatron.algorithms import PolicyLossConfig
from gspo_megatron.backends.megatron.policy import build_policy
from gspo_megatron.backends.megatron.schedule import ScoringConfig, compute_logprobs
from gspo_megatron.config import OptimConfig
from gspo_megatron.config.model import ParallelConfig, PrecisionConfig, model_config_from_preset
from gspo_megatron.policy import make_policy_batch
from tests.helpers.megatron import train_minibatch

pytestmark = pytest.mark.slow  # builds Megatron models (make test-fast skips it)


@pytest.fixture(scope="module")
def groups():
    from gspo_megatron.backends.megatron.parallel import destroy_distributed, initialize_distributed

    g = initialize_distributed(ParallelConfig(), model_config_from_preset("tiny"), seed=5)
    yield g
    destroy_distributed()


def _inner_groups(policy):
    opt = policy.optimizer
    return [g for o in getattr(opt, "chained_optimizers", [opt]) for g in o.optimizer.param_groups]


def _policy(groups):
    # weight decay on (a decayed and an undecayed group), clipping active at this lr
    optim = OptimConfig(lr=3e-3, weight_decay=0.1, clip_grad=0.05, lr_warmup_steps=2,
                        lr_decay_style="cosine", min_lr=1e-4)
    return build_policy(model_config_from_preset("tiny"), ParallelConfig(), PrecisionConfig(),
                        optim, groups, total_steps=6)


def _steps(policy, groups, n=5):
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(1, 100, (int(k),), generator=gen).tolist()
            for k in torch.randint(6, 14, (8,), generator=gen)]
    batch = make_policy_batch(seqs, [3] * 8, pad_id=0)
    batch.advantages = torch.randn(8, generator=gen)
    scoring = ScoringConfig(vocab_size=100)
    batch.old_logprobs, _ = compute_logprobs(policy.model, batch, 4, scoring, groups)
    norms = []
    for _ in range(n):
        policy.zero_grad()
        train_minibatch(policy.model, batch, 4, PolicyLossConfig(variant="gspo"), scoring, groups)
        applied, norm = policy.optimizer_step()
        assert applied
        norms.append(norm)
    return norms


def _adam_states(policy):
    return [o.optimizer.state for o in getattr(policy.optimizer, "chained_optimizers",
                                                [policy.optimizer])]


@pytest.mark.parametrize("clip_grad", [0.05, 0.0, 1e9])
def test_lean_step_is_megatrons_step_bitwise(groups, clip_grad):
    """Against Megatron's own ``optimizer.step()`` (the same fused AdamW inside): the same
    gradient norms, weights and Adam state after 5 steps, with clipping active on every step
    (0.05), disabled (0) and never triggered (1e9)."""
    fast, slow = _policy(groups), _policy(groups)
    for pol in (fast, slow):
        for o in getattr(pol.optimizer, "chained_optimizers", [pol.optimizer]):
            o.config.clip_grad = clip_grad
    fast.copy_weights_to(slow)
    assert fast._lean_step
    assert {g["weight_decay"] for g in _inner_groups(fast)} == {0.0, 0.1}
    slow.__dict__["_lean_step"] = False  # Megatron's step()
    norms_fast, norms_slow = _steps(fast, groups), _steps(slow, groups)
    assert norms_fast == norms_slow and max(norms_fast) > 0.05  # clipped steps at clip_grad 0.05
    slow_params = dict(slow.unwrapped().named_parameters())
    for name, p in fast.unwrapped().named_parameters():
        assert torch.equal(p, slow_params[name]), name
    for state_f, state_s in zip(_adam_states(fast), _adam_states(slow)):
        for (pf, sf), (ps, ss) in zip(state_f.items(), state_s.items(), strict=True):
            assert pf.shape == ps.shape and sorted(sf) == sorted(ss)
            assert all(torch.equal(sf[k], ss[k]) for k in sf)  # step, exp_avg, exp_avg_sq


def test_fused_adamw_follows_the_per_parameter_loop(groups):
    """CPU groups run torch's fused AdamW (TRL's / Hugging Face's default,
    ``adamw_torch_fused``); after 5 clipped steps with weight decay its weights and Adam state
    equal the per-parameter loop's (torch's CPU default) to float32 rounding, and the updates
    themselves are far larger than the difference."""
    fused, loop = _policy(groups), _policy(groups)
    fused.copy_weights_to(loop)
    start = {n: p.detach().clone() for n, p in fused.unwrapped().named_parameters()}
    assert all(g["fused"] is True and not g["foreach"] for g in _inner_groups(fused))
    for g in _inner_groups(loop):
        g["fused"], g["foreach"] = False, False  # torch's default on CPU: _single_tensor_adam
    norms_fused, norms_loop = _steps(fused, groups), _steps(loop, groups)
    torch.testing.assert_close(norms_fused, norms_loop, rtol=1e-4, atol=0)
    loop_params = dict(loop.unwrapped().named_parameters())
    moved = 0.0
    for name, p in fused.unwrapped().named_parameters():
        torch.testing.assert_close(p, loop_params[name], rtol=1e-5, atol=1e-6)
        moved = max(moved, float((p.detach() - start[name]).abs().max()))
    assert moved > 1e-3  # 5 steps at lr 3e-3 moved the weights
    for state_f, state_l in zip(_adam_states(fused), _adam_states(loop)):
        for (_, sf), (_, sl) in zip(state_f.items(), state_l.items(), strict=True):
            for k in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(sf[k], sl[k], rtol=1e-4, atol=1e-9)
            assert torch.equal(sf["step"], sl["step"])


def test_nonfinite_check_reads_the_flat_buffers(groups):
    policy = _policy(groups)
    _steps(policy, groups, n=1)
    buffers = policy._grad_buffers
    assert buffers is not None
    assert sum(b.numel() for b in buffers) >= sum(p.numel() for p in policy.unwrapped().parameters())
    assert policy.grads_are_finite()
    params = [p for p in policy.unwrapped().parameters() if hasattr(p, "main_grad")]
    for param, bad in ((params[0], float("nan")), (params[-1], float("inf")),
                       (params[len(params) // 2], float("-inf"))):
        saved = param.main_grad.clone()
        param.main_grad.view(-1)[-1] = bad
        assert not policy.grads_are_finite()
        param.main_grad.copy_(saved)
        assert policy.grads_are_finite()
    # A skipped step leaves weights and Adam state alone.
    before = [p.detach().clone() for p in params]
    applied, norm = policy.optimizer_step(corrupt_grad=lambda g: g * float("nan"))
    assert not applied and norm != norm
    assert all(torch.equal(a, p) for a, p in zip(before, params))


def test_single_rank_finalize_is_megatrons(groups):
    from megatron.core.distributed import finalize_model_grads

    from gspo_megatron.backends.megatron.policy import single_rank_finalize_model_grads

    a, b = _policy(groups), _policy(groups)
    a.copy_weights_to(b)
    assert a.transformer_config.finalize_model_grads_func is single_rank_finalize_model_grads
    b.transformer_config.finalize_model_grads_func = finalize_model_grads
    norms = [_steps(p, groups, n=3) for p in (a, b)]
    assert norms[0] == norms[1]
    params_b = dict(b.unwrapped().named_parameters())
    for name, p in a.unwrapped().named_parameters():
        assert torch.equal(p.main_grad, params_b[name].main_grad) and torch.equal(p, params_b[name])
    groups_a = a.model[0].bucket_groups + a.model[0].expert_parallel_bucket_groups
    assert groups_a and not any(g.param_gather_dispatched for g in groups_a)


def test_set_training_is_module_train(groups):
    from gspo_megatron.backends.megatron.schedule import set_training

    policy = _policy(groups)
    modules = list(policy.model[0].modules())
    assert len(modules) > 50
    set_training(policy.model, False)
    assert not any(m.training for m in modules)
    set_training(policy.model, True)
    assert all(m.training for m in modules)
    policy.model[0].eval()
    expected = [m.training for m in modules]
    set_training(policy.model, True)
    set_training(policy.model, False)
    assert [m.training for m in modules] == expected
    set_training(policy.model, True)


def test_reduce_metrics_of_one_microbatch_is_the_general_reduction():
    """One microbatch on one rank takes a single stack + tolist; the values are the general
    path's (sum for loss/*, min/max by suffix, else mean, each of one float32 value)."""
    from gspo_megatron.backends.megatron.schedule import reduce_metrics

    class OneRank:
        dp_size, dp_group = 1, None

    gen = torch.Generator().manual_seed(3)
    out = {f"loss/{i}": torch.randn((), generator=gen, dtype=torch.float64) for i in range(3)}
    out.update({f"x/{i}_min": torch.randn((), generator=gen) for i in range(3)})
    out.update({f"x/{i}_max": torch.randn((), generator=gen) * 1e30 for i in range(3)})
    out.update({f"y/{i}": torch.randn((), generator=gen, dtype=torch.float64) / 3 for i in range(5)})
    out["z/nan"] = torch.tensor(float("nan"))
    fast = reduce_metrics([out], OneRank())
    for key, value in out.items():
        vals = torch.stack([value.float().reshape(())])
        ref = (vals.sum() if key.startswith("loss/") else vals.min() if key.endswith("min")
               else vals.max() if key.endswith("max") else vals.mean())
        assert repr(fast[key]) == repr(float(ref)), key
    assert list(fast) == sorted(out)


def _through_buckets(pieces, bucket_bytes: int):
    """``pieces`` as a rollout rank receives them: packed into buckets of ``bucket_bytes``, each
    bucket copied out of the sender's snapshot into one reused buffer."""
    from gspo_megatron.weight_pieces import pack

    layout = pack([p.box for p in pieces], bucket_bytes)
    snapshot = torch.empty(layout.total, dtype=torch.uint8)
    layout.fill(pieces, snapshot)
    inbox = torch.empty(layout.largest, dtype=torch.uint8)
    for b, size in enumerate(layout.sizes):
        inbox[:size].copy_(layout.bucket(b, snapshot))
        yield from layout.views(b, inbox[:size])


def test_a_frozen_policy_keeps_no_gradient_buffer_and_scores_as_the_policy(groups):
    """``build_policy(frozen=True)`` (the KL reference, a rollout rank's replica) builds Megatron
    DDP with no fp32 gradient buffer (4 bytes a parameter saved) and, its parameters trainable
    again afterwards, gives the trained policy's log-probs bitwise on the same weights (loaded
    piece by piece through 4 KiB buckets, as a rollout rank's replica is)."""
    model = model_config_from_preset("tiny")
    policy = _policy(groups)
    frozen = build_policy(model, ParallelConfig(), PrecisionConfig(), OptimConfig(), groups,
                          total_steps=1, with_optimizer=False, frozen=True)
    ddp, ddp_frozen = policy.model[0], frozen.model[0]
    n = sum(p.numel() for p in policy.unwrapped().parameters())
    grad_bytes = sum(b.grad_data.numel() * b.grad_data.element_size() for b in ddp.buffers)
    assert grad_bytes >= 4 * n and not ddp_frozen.buffers and not ddp_frozen.expert_parallel_buffers
    assert all(p.requires_grad for p in frozen.unwrapped().parameters())
    _steps(policy, groups, n=2)  # weights the fresh model does not have
    frozen.load_weight_pieces(_through_buckets(policy.weight_pieces(), 4096))
    # the piece index is built once per model and rebuilt when a parameter's storage moves
    pieces = frozen._pieces()
    assert frozen._pieces() is pieces
    param = next(frozen.unwrapped().parameters())
    param.data = param.data.clone()
    assert frozen._pieces() is not pieces
    _steps(policy, groups, n=1)  # new weights: written into the moved parameter, not the old
    frozen.load_weight_pieces(_through_buckets(policy.weight_pieces(), 4096))
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(1, 100, (int(k),), generator=gen).tolist()
            for k in torch.randint(6, 14, (6,), generator=gen)]
    batch = make_policy_batch(seqs, [3] * 6, pad_id=0)
    scoring = ScoringConfig(vocab_size=100)
    with torch.no_grad():
        a, _ = compute_logprobs(policy.model, batch, 4, scoring, groups)
        b, _ = compute_logprobs(frozen.model, batch, 4, scoring, groups)
    assert torch.equal(a, b)


@pytest.mark.parametrize("budget", [None, 60])
def test_logprob_passes_take_their_own_microbatch_size(groups, monkeypatch, budget):
    """``trainer.logprob_micro_batch_size``: the no-grad log-prob pass cuts the batch into its
    own microbatches (padded: 2 of 4 sequences, against 4 of 2 for the update's size; packed:
    the token budget scaled by ``logprob_micro_batch_size / micro_batch_size``, 60 -> 120, so
    fewer microbatches) and scores every sequence as the update's microbatches do."""
    from gspo_megatron.backends.megatron import schedule

    model = model_config_from_preset("tiny")
    pols = {mbs: build_policy(model, ParallelConfig(), PrecisionConfig(), OptimConfig(), groups,
                              total_steps=1, with_optimizer=False, micro_batch_size=2,
                              max_tokens_per_microbatch=budget, logprob_micro_batch_size=mbs)
            for mbs in (None, 4)}
    pols[None].copy_weights_to(pols[4])
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(1, 100, (int(k),), generator=gen).tolist()
            for k in torch.randint(5, 20, (10,), generator=gen)]
    batch = make_policy_batch(seqs, [2] * 10, pad_id=0)
    cuts = []
    real = schedule.make_microbatches
    monkeypatch.setattr(schedule, "make_microbatches", lambda b, batching, g: cuts.append(
        (batching.micro_batch_size, batching.max_tokens, len(out := real(b, batching, g)))) or out)
    lp = {mbs: pol.logprobs(batch) for mbs, pol in pols.items()}
    (size_a, budget_a, count_a), (size_b, budget_b, count_b) = cuts
    if budget is None:
        assert (size_a, size_b, budget_a, budget_b, count_a, count_b) == (2, 4, None, None, 5, 3)
    else:
        assert (budget_a, budget_b) == (60, 120) and count_b < count_a
    mask = batch.response_mask.bool()
    assert mask.sum() > 20
    torch.testing.assert_close(lp[4][mask], lp[None][mask], rtol=1e-5, atol=1e-6)


def test_an_update_after_a_first_pass_in_inference_mode(groups):
    """A run without SFT: the first forward with a loss is the old-log-prob pass, in inference
    mode. Megatron's MoE aux-loss scale holder (a class attribute that forward creates once,
    then updates in place) must come out of it usable by the update's forward and backward."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    policy = _policy(groups)
    gen = torch.Generator().manual_seed(8)
    seqs = [torch.randint(1, 100, (int(k),), generator=gen).tolist()
            for k in torch.randint(6, 14, (8,), generator=gen)]
    batch = make_policy_batch(seqs, [3] * 8, pad_id=0)
    batch.advantages = torch.randn(8, generator=gen)
    saved = MoEAuxLossAutoScaler.main_loss_backward_scale
    MoEAuxLossAutoScaler.main_loss_backward_scale = None  # as in a fresh process
    try:
        batch.old_logprobs = policy.logprobs(batch)
        assert not batch.old_logprobs.is_inference()
        assert not MoEAuxLossAutoScaler.main_loss_backward_scale.is_inference()
        policy.zero_grad()
        train_minibatch(policy.model, batch, 4, PolicyLossConfig(variant="gspo"),
                        ScoringConfig(vocab_size=100), groups)
        applied, _ = policy.optimizer_step()
        assert applied
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = saved


class _MainCopyOptimizer:
    """Megatron's bf16 optimizer as far as the weights go (``Float16OptimizerWithFloat16Params``
    needs CUDA tensors): it steps fp32 *main* copies taken when it was built and writes them back
    into the model; ``reload_model_params`` takes fresh copies."""

    def __init__(self, model):
        self.params = [p for chunk in model for p in chunk.parameters()]
        self.reload_model_params()

    def reload_model_params(self, state_dict=None):
        self.main = [p.detach().double().clone() for p in self.params]

    def step(self):  # a zero update: the model becomes its main copies again
        with torch.no_grad():
            for p, m in zip(self.params, self.main):
                p.copy_(m)


def test_weights_changed_outside_the_optimizer_survive_its_next_step(groups, tmp_path):
    """A warm-up with another optimizer, or weights loaded or imported, must reach the policy
    optimizer's main copies: on an H200 (bf16) the demo's SFT warm-up was undone by the first RL
    step before ``MegatronPolicy`` told its optimizer (held-out accuracy 0.108 -> 0.008)."""
    policy = _policy(groups)
    policy.optimizer = _MainCopyOptimizer(policy.model)
    params = policy.optimizer.params

    def bump():
        with torch.no_grad():
            for p in params:
                p.add_(0.25)
        return [p.detach().clone() for p in params]

    with policy.temporary_optimizer(OptimConfig(lr=1e-3), total_steps=1):
        changed = bump()  # what the warm-up's own optimizer would have written
    policy.optimizer.step()
    assert all(torch.equal(p, c) for p, c in zip(params, changed))

    policy.save_weights(str(tmp_path / "w"))
    bump()
    policy.load_weights(str(tmp_path / "w"))
    policy.optimizer.step()
    assert all(torch.equal(p, c) for p, c in zip(params, changed))
