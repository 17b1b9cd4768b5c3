"""Benchmark: our GSPO step against TRL's ``GRPOTrainer`` in GSPO mode, on TRL's own workload.

    pip install -e '.[bench]'                      # TRL 1.16.0, the peer (optional)
    python -m tools.bench.trl_peer [--rounds 3] [--steps 3]

The workload (issue 16): a random Qwen3-MoE with hidden 64, 2 layers, 8 experts top-2, expert width
32, 4 heads / 2 KV heads, head_dim 16; 16 prompts x 8 completions of at most 16 new tokens per
generation; 4 optimiser steps per generation batch (one microbatch of 32 each); fp32 on CPU, one
thread, no KL term.

* TRL 1.16.0: ``GRPOTrainer`` with ``importance_sampling_level="sequence"``, ``beta=0``,
  ``loss_type="grpo"``, ``steps_per_generation=4``, Hugging Face ``generate``, on the arithmetic
  prompts with an exact-match reward.
* Ours: ``gspo-train``'s trainer on ``examples/configs/tiny_gspo.yaml`` (16 new tokens, no SFT),
  one :meth:`Trainer.rl_step` per generation.

Every setting that changes the work is the same on both sides (:data:`EQUAL`, issue 34 item 4):

* the same model and tokenizer (:func:`hf_start`): one random ``Qwen3MoeForCausalLM`` (seed 0)
  and an 18-entry character tokenizer (pad, unk, bos, EOS, ``0-9+-=*``). TRL trains them as they
  are; ours converts the model with ``gspo-convert-hf``'s function, its vocabulary unpadded
  (``make_vocab_size_divisible_by=1``: Megatron's padding to 128 would make our output layer,
  log-softmax and entropy 7x TRL's), and reads the tokenizer with ``tokenizer.kind=hf``. Both
  start from the same distribution, so with EOS both write the same expected number of tokens
  (until session 18 each side initialised a random model of its own, and ours wrote ~6 % more).
  Sampling over all 18 ids, temperature 1, top-p 1, top-k off.
* stopping rule: ``eos`` mode, a response ends at EOS or after 16 tokens; ``full_length`` mode,
  every response is 16 tokens (TRL ``min_new_tokens=16``, which masks EOS until then; ours
  ``rollout.ignore_eos``, which samples EOS and goes on: the same 2,048 tokens, the support
  differs by the EOS id only).
* optimiser: AdamW, lr ``LR`` constant (no warm-up, no decay; ours overrides the recipe's
  warm-up + cosine), weight decay 0, betas 0.9 / 0.999, eps 1e-8, gradient-norm clip 1.0. TRL
  runs its default ``adamw_torch_fused``, ours Megatron's fp32 optimizer over ``torch.optim.AdamW``.
* GSPO clip eps 3e-4 / 4e-4; group-std advantage normalisation; entropy computed in every
  training microbatch on both sides (TRL logs it, ours too); old log-probs recomputed by one
  no-grad forward over the 128 sequences on both sides. How that pass is cut is not the work:
  TRL runs it in microbatches of its ``per_device_train_batch_size`` (32; it has no separate
  setting), ours in one of 128 (``trainer.logprob_micro_batch_size``, verl's
  ``log_prob_micro_batch_size_per_gpu``: no activations are kept, so it fits);
  ``--logprob-micro-batch 32`` runs ours cut as TRL's.
* no router load-balancing loss: TRL's Hugging Face model computes none in training
  (``Qwen3MoeConfig.output_router_logits`` defaults to False, so ``router_aux_loss_coef`` is never
  applied); ours runs with ``model.moe_router_load_balancing_type=none``,
  ``model.moe_aux_loss_coeff=0`` (the recipe's 1e-3 aux loss adds ~4 ms of router work to the 4
  updates).
* no activation recomputation: TRL's ``GRPOConfig`` turns gradient checkpointing on by default
  (an extra forward per update); it is off here, as ours has none.
* prompts: the project's arithmetic problems (``+`` and ``-``, operands 0-20) on both sides.

The lr (1e-6, both libraries' default for RL fine-tuning) keeps the random model near its
initial, nearly uniform distribution for the whole run (EOS at ~1/18 per token: ~10.8 tokens per
response, ~1,350 per generation).

Two modes (:data:`MODES`): ``eos`` (responses end at EOS, as in training) and ``full_length``.
Each side runs in a fresh process per round and mode (alternating which goes first); in each, the
first generation is a warm-up and ``--steps`` generations are timed. Per generation + 4 updates it
reports the median of: the whole RL step; the rollout (TRL: ``_generate_single_turn``, i.e. HF
``generate``; ours: ``perf/rollout_s``) and its tokens/s; the rest of the step (reward, old
log-probs, the 4 updates: the step minus the rollout, on both sides).
"""

from __future__ import annotations

import json
import sys
import time

SHAPE = dict(vocab_size=18, hidden_size=64, num_layers=2, num_attention_heads=4,
             num_query_groups=2, kv_channels=16, num_moe_experts=8, moe_router_topk=2,
             moe_ffn_hidden_size=32)
PROMPTS, GROUP, NEW_TOKENS, UPDATES = 16, 8, 16, 4
LOGPROB_MICRO_BATCH = PROMPTS * GROUP
"""Ours: the old-log-prob pass in one microbatch (TRL's: 4 of 32, not settable there)."""
LR = 1e-6
TRL_VOCAB = ["<pad>", "<unk>", "<s>", "<eos>", *"0123456789+-=*"]
"""The character tokenizer both sides use (:func:`hf_start`); the model's vocabulary is exactly
these 18 ids (``SHAPE['vocab_size']``)."""
assert len(TRL_VOCAB) == SHAPE["vocab_size"]
EQUAL = {
    "model_and_tokenizer": "the same random Qwen3-MoE (seed 0) and 18-entry tokenizer",
    "sampling_support_ids": len(TRL_VOCAB), "model_vocab_size": SHAPE["vocab_size"],
    "temperature": 1.0, "top_p": 1.0, "top_k": 0,
    "max_new_tokens": NEW_TOKENS, "lr": LR, "lr_schedule": "constant, no warm-up",
    "weight_decay": 0.0, "adam_betas": [0.9, 0.999], "adam_eps": 1e-8, "grad_clip": 1.0,
    "clip_eps": [3e-4, 4e-4], "kl_coef": 0.0, "activation_recompute": False,
    "entropy_in_updates": True, "router_aux_loss": False,
    "old_logprobs": "recomputed, one no-grad forward over the 128 sequences",
    "prompts": "arithmetic, + and -, operands 0-20"}
"""The settings that change the work, the same on both sides (module docstring)."""


def trl_available() -> str | None:
    """TRL's version, or None when it is not installed."""
    try:
        from importlib.metadata import version

        return version("trl")
    except Exception:  # noqa: BLE001 - any failure means "not installed"
        return None


def hf_start(new_tokens: int = NEW_TOKENS):
    """``(model, tokenizer)`` both sides start from: a random ``Qwen3MoeForCausalLM`` of
    :data:`SHAPE` (fp32, ``torch.manual_seed(0)``, so every process builds the same weights) and
    the 18-entry character tokenizer of :data:`TRL_VOCAB`. TRL trains them as they are; ours
    converts them (:func:`_our_start`)."""
    import torch
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=SHAPE["vocab_size"], hidden_size=SHAPE["hidden_size"], intermediate_size=128,
        num_hidden_layers=SHAPE["num_layers"], num_attention_heads=SHAPE["num_attention_heads"],
        num_key_value_heads=SHAPE["num_query_groups"], head_dim=SHAPE["kv_channels"],
        moe_intermediate_size=SHAPE["moe_ffn_hidden_size"], num_experts=SHAPE["num_moe_experts"],
        num_experts_per_tok=SHAPE["moe_router_topk"], norm_topk_prob=True,
        max_position_embeddings=16 + new_tokens, tie_word_embeddings=False)).float()
    assert not model.config.output_router_logits  # no aux loss in training (EQUAL)
    vocab = {t: i for i, t in enumerate(TRL_VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                        eos_token="<eos>", unk_token="<unk>")
    return model, tokenizer


def _our_start(directory: str, new_tokens: int = NEW_TOKENS) -> str:
    """:func:`hf_start` saved under ``directory/trl_peer_start`` and converted with
    ``gspo-convert-hf``'s function (the vocabulary unpadded, as TRL's model's) into
    ``directory/mcore``: what ``checkpoint.init_weights`` and ``tokenizer.path`` name. Returns
    ``directory``."""
    import os

    from gspo_megatron.tools.convert_hf import convert_hf_to_mcore

    model, tokenizer = hf_start(new_tokens)
    hf_dir = os.path.join(directory, "trl_peer_start")
    model.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    convert_hf_to_mcore(hf_dir, os.path.join(directory, "mcore"), make_vocab_size_divisible_by=1)
    return directory


def _trl_side(steps: int, smoke: bool, new_tokens: int = NEW_TOKENS, group: int = GROUP,
              full_length: bool = False) -> dict:
    import tempfile

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from gspo_megatron.data.arithmetic import make_arithmetic_dataset

    torch.set_num_threads(1)
    model, tokenizer = hf_start(new_tokens)
    prompts_per_gen = 2 if smoke else PROMPTS
    group = 2 if smoke else group
    generations = 1 + steps
    # The project's arithmetic problems ("12+7=" -> "19"), drawn with replacement.
    data = make_arithmetic_dataset(prompts_per_gen * generations, unique=False)
    dataset = Dataset.from_dict({"prompt": [e.prompt for e in data],
                                 "answer": [e.answer for e in data]})

    def exact(completions, answer, **_):
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    batch = prompts_per_gen * group // UPDATES
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="gspo_bench_trl_"), use_cpu=True, bf16=False,
        per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        steps_per_generation=UPDATES, num_generations=group,
        max_completion_length=2 if smoke else new_tokens,
        importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4,
        beta=0.0, temperature=1.0, top_p=1.0, top_k=0, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, gradient_checkpointing=False,
        max_steps=UPDATES * generations,
        report_to=[], save_strategy="no", logging_steps=10_000, disable_tqdm=True, seed=0,
        shuffle_dataset=False, dataloader_num_workers=0,
        # full_length: EOS masked until the last token, every completion max_completion_length long
        generation_kwargs={"min_new_tokens": new_tokens} if full_length else None)
    step_end: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_end.append(time.perf_counter())

    trainer = GRPOTrainer(model=model, reward_funcs=exact, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepTimes()])
    gen_s, gen_tokens = [], []
    generate_single = trainer._generate_single_turn

    def timed_generate(*a, **k):
        t = time.perf_counter()
        out = generate_single(*a, **k)
        gen_s.append(time.perf_counter() - t)
        gen_tokens.append(sum(len(c) for c in out[0]))  # (completion_ids, logprobs)
        return out

    trainer._generate_single_turn = timed_generate
    start = time.perf_counter()
    trainer.train()
    ends = [start] + step_end
    step_s = [ends[UPDATES * (g + 1)] - ends[UPDATES * g] for g in range(generations)]
    return {"step_s": step_s[1:], "rollout_s": gen_s[1:], "rollout_tokens": gen_tokens[1:],
            "updates_s": [s - g for s, g in zip(step_s, gen_s)][1:]}


def our_overrides(start: str, steps: int, smoke: bool = False, new_tokens: int = NEW_TOKENS,
                  group: int = GROUP, full_length: bool = False,
                  logprob_micro_batch: int = LOGPROB_MICRO_BATCH) -> list[str]:
    """``tiny_gspo.yaml`` overrides for our side: TRL's model and tokenizer (``start``, made by
    :func:`_our_start`: the model's architecture comes from its ``model_config.json``) and
    :data:`EQUAL`'s settings."""
    import os

    prompts, group = (2, 2) if smoke else (PROMPTS, group)
    new_tokens = 2 if smoke else new_tokens
    return [
        "sft.steps=0", f"checkpoint.init_weights={os.path.join(start, 'mcore')}",
        "model.preset=trl_peer_start", "tokenizer.kind=hf",
        f"tokenizer.path={os.path.join(start, 'trl_peer_start')}",
        "model.moe_router_load_balancing_type=none", "model.moe_aux_loss_coeff=0",
        f"rollout.max_new_tokens={new_tokens}", f"model.seq_length={16 + new_tokens}",
        f"rollout.prompts_per_step={prompts}", f"rollout.group_size={group}",
        f"trainer.num_minibatches={UPDATES}",
        f"trainer.micro_batch_size={prompts * group // UPDATES}",
        f"trainer.logprob_micro_batch_size={min(logprob_micro_batch, prompts * group)}",
        "loss.clip_low=3e-4", "loss.clip_high=4e-4", "loss.kl_coef=0.0",
        f"optim.lr={LR}", "optim.min_lr=0.0", "optim.lr_warmup_steps=0",
        "optim.lr_decay_style=constant", "optim.weight_decay=0.0", "optim.adam_beta1=0.9",
        "optim.adam_beta2=0.999", "optim.adam_eps=1e-8", "optim.clip_grad=1.0",
        "rollout.temperature=1.0", "rollout.top_p=1.0", "rollout.top_k=0",
        "data.num_eval_examples=2", "trainer.eval_interval=0", f"trainer.steps={1 + steps}",
        f"rollout.ignore_eos={str(full_length).lower()}"]


def _our_side(steps: int, smoke: bool, new_tokens: int = NEW_TOKENS, group: int = GROUP,
              full_length: bool = False, logprob_micro_batch: int = LOGPROB_MICRO_BATCH) -> dict:
    import tempfile

    import torch

    from tools.bench.common import quiet_megatron, tiny_trainer

    quiet_megatron()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="gspo_bench_start_") as start:
        overrides = our_overrides(_our_start(start, new_tokens), steps, smoke, new_tokens, group,
                                  full_length, logprob_micro_batch)
        with tiny_trainer(overrides) as (trainer, _):
            # TRL's tokenizer, and a model with TRL's whole vocabulary (no padded columns)
            assert trainer.task.tokenizer.vocab_size == len(TRL_VOCAB)
            assert trainer.policy.unwrapped().vocab_size == SHAPE["vocab_size"]
            records = [trainer.rl_step() for _ in range(1 + steps)][1:]
    return {"step_s": [r["perf/step_s"] for r in records],
            "rollout_s": [r["perf/rollout_s"] for r in records],
            "rollout_tokens": [r["perf/rollout_tokens_per_s"] * r["perf/rollout_s"]
                               for r in records],
            "updates_s": [r["perf/step_s"] - r["perf/rollout_s"] for r in records],
            "stages_s": {k[5:-2]: [r[k] for r in records] for k in
                         ("perf/rollout_s", "perf/reward_s", "perf/old_logprobs_s",
                          "perf/update_s")}}


MODES = {"eos": [], "full_length": ["--full-length"]}
"""``eos``: responses end at EOS (as trained); ``full_length``: every response is exactly 16 tokens
(TRL: ``min_new_tokens``; ours: ``rollout.ignore_eos``), the same work on both sides."""


def run(smoke: bool = False, rounds: int = 3, steps: int = 3,
        logprob_micro_batch: int = LOGPROB_MICRO_BATCH) -> dict:
    from tools.bench.common import make_result, median, row, run_child

    version = trl_available()
    target = ("ours <= 0.8x TRL's RL step at equal settings in both modes; rollout tokens/s "
              ">= 1.0x TRL's at equal work (full-length responses)")
    title = "GSPO RL step vs TRL GRPOTrainer (GSPO mode), TRL's workload"
    if version is None:
        return make_result("trl_peer", title, target, None,
                           [row("skipped", "TRL is not installed: pip install -e '.[bench]' "
                                "(trl==1.16.0)", "")], notes=["not run: TRL is not installed"])
    if smoke:
        rounds, steps = 1, 1
    sides = {mode: {"trl": [], "ours": []} for mode in MODES}
    for r in range(rounds):
        for mode, extra in MODES.items():
            for side in (("trl", "ours") if r % 2 == 0 else ("ours", "trl")):
                args = ["--side", side, "--steps", str(steps), *extra]
                if side == "ours":
                    args += ["--logprob-micro-batch", str(logprob_micro_batch)]
                sides[mode][side].append(run_child("tools.bench.trl_peer",
                                                   args + (["--smoke"] if smoke else [])))

    def pooled(mode, side, key):
        return [x for rec in sides[mode][side] for x in rec[key]]

    med = {mode: {side: {
        "step": median(pooled(mode, side, "step_s")),
        "rollout": median(pooled(mode, side, "rollout_s")),
        "updates": median(pooled(mode, side, "updates_s")),
        "tokens": median(pooled(mode, side, "rollout_tokens")),
        "tok_s": median(t / s for t, s in zip(pooled(mode, side, "rollout_tokens"),
                                              pooled(mode, side, "rollout_s")))}
        for side in ("trl", "ours")} for mode in MODES}
    ratios, rows = {}, []
    for mode in MODES:
        m = med[mode]
        ratios[f"{mode}/step_ours_over_trl"] = m["ours"]["step"] / m["trl"]["step"]
        ratios[f"{mode}/rollout_tokens_per_s_ours_over_trl"] = m["ours"]["tok_s"] / m["trl"]["tok_s"]
        ratios[f"{mode}/rollout_time_ours_over_trl"] = m["ours"]["rollout"] / m["trl"]["rollout"]
        ratios[f"{mode}/updates_ours_over_trl"] = m["ours"]["updates"] / m["trl"]["updates"]
        for side, label in (("trl", f"TRL {version}"), ("ours", "ours")):
            rows += [
                row(f"{mode}: {label}: RL step (generation + {UPDATES} updates)",
                    m[side]["step"], "s"),
                row(f"{mode}: {label}: rollout", m[side]["rollout"], "s"),
                row(f"{mode}: {label}: tokens per generation", m[side]["tokens"], "tok"),
                row(f"{mode}: {label}: rollout tokens/s", m[side]["tok_s"], "tok/s"),
                row(f"{mode}: {label}: rest of the step (reward, old log-probs, {UPDATES} "
                    "updates)", m[side]["updates"], "s")]
        rows += [row(f"{mode}: RL step, ours / TRL (time)", ratios[f"{mode}/step_ours_over_trl"], "x"),
                 row(f"{mode}: rollout time, ours / TRL",
                     ratios[f"{mode}/rollout_time_ours_over_trl"], "x"),
                 row(f"{mode}: rollout tokens/s, ours / TRL",
                     ratios[f"{mode}/rollout_tokens_per_s_ours_over_trl"], "x"),
                 row(f"{mode}: rest of the step, ours / TRL (time)",
                     ratios[f"{mode}/updates_ours_over_trl"], "x")]
    met = (all(ratios[f"{mode}/step_ours_over_trl"] <= 0.8 for mode in MODES)
           and ratios["full_length/rollout_tokens_per_s_ours_over_trl"] >= 1.0)
    return make_result(
        "trl_peer", title, target, met, rows, ratios,
        config={"trl": version, "rounds": rounds, "steps": steps, "shape": SHAPE,
                "prompts": PROMPTS, "group": GROUP, "new_tokens": NEW_TOKENS,
                "updates": UPDATES, "equal": EQUAL,
                "old_logprob_microbatches": {"trl": 32, "ours": logprob_micro_batch},
                "per_round": sides},
        notes=[f"median over {rounds} fresh processes per side and mode x {steps} generations "
               "(1 warm-up generation each), alternating which side runs first; fp32, 1 thread",
               "equal on both sides: " + ", ".join(f"{k} {v}" for k, v in EQUAL.items()),
               f"old-log-prob pass cut into microbatches of 32 (TRL) and {logprob_micro_batch} "
               "(ours, trainer.logprob_micro_batch_size): the same forward work",
               "eos: both sides start from the same model and tokenizer (18 ids, all sampled), so "
               "EOS ends a response equally often in expectation; a static batch still decodes "
               "until its longest response ends",
               "full_length: every response is 16 tokens on both sides (TRL min_new_tokens, ours "
               "rollout.ignore_eos): 2,048 tokens per generation, the same work"])


def _side_main(argv: list[str]) -> None:
    """``--side trl|ours``: one side in this process (the child ``run`` starts); prints its JSON."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--side", choices=("trl", "ours"), required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    ap.add_argument("--group", type=int, default=GROUP)
    ap.add_argument("--full-length", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--logprob-micro-batch", type=int, default=LOGPROB_MICRO_BATCH)
    args = ap.parse_args(argv)
    if args.side == "trl":
        res = _trl_side(args.steps, args.smoke, args.new_tokens, args.group, args.full_length)
    else:
        res = _our_side(args.steps, args.smoke, args.new_tokens, args.group, args.full_length,
                        args.logprob_micro_batch)
    print(json.dumps(res), flush=True)


def _args(ap) -> None:
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--logprob-micro-batch", type=int, dest="logprob_micro_batch",
                    help=f"ours: sequences per old-log-prob microbatch (default "
                         f"{LOGPROB_MICRO_BATCH}; 32 = TRL's)")


if __name__ == "__main__":
    if "--side" in sys.argv:
        _side_main(sys.argv[1:])
    else:
        from tools.bench.common import module_main

        module_main(run, extra_args=_args)
