"""``gspo-train --config recipe.yaml [--section.field=value ...]``: the RL run, CPU or cluster.

Reads the config, validates it before any compute, builds every component, optionally warms the
policy up with a supervised phase, runs the RL loop with checkpoints, and reports held-out accuracy
before and after RL. Without ``--config`` it runs the embedded default: a tiny MoE on CPU learning
the built-in arithmetic task.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time

import torch

from gspo_megatron.config import TrainConfig

logger = logging.getLogger("gspo_megatron")


def setup_tokenizer_and_data(cfg: TrainConfig):
    """Tokenizer, training examples and held-out examples for ``cfg.data``."""
    from gspo_megatron import data as data_lib
    from gspo_megatron.tokenizer import build_tokenizer, train_sentencepiece

    if cfg.data.source == "arithmetic":
        train, heldout = data_lib.make_arithmetic_splits(
            cfg.data.num_train_examples, cfg.data.num_eval_examples, seed=cfg.trainer.seed,
            max_operand=cfg.data.max_operand, heldout_fraction=cfg.data.heldout_fraction)
    else:
        train = data_lib.load_prompt_dataset(cfg.data.train_path, prompt_key=cfg.data.prompt_key,
                                             answer_key=cfg.data.answer_key)
        heldout = (data_lib.load_prompt_dataset(cfg.data.eval_path, prompt_key=cfg.data.prompt_key,
                                                answer_key=cfg.data.answer_key)
                   if cfg.data.eval_path else [])

    if cfg.tokenizer.path:
        tokenizer = build_tokenizer(cfg.tokenizer.kind, cfg.tokenizer.path)
    elif cfg.tokenizer.kind == "sentencepiece":
        # Trained in-process on the task's text (deterministic); every rank trains the same one,
        # so no rank waits on a file. Saved with the run once everything has been validated.
        corpus = data_lib.arithmetic_tokenizer_corpus(train + heldout)
        tokenizer = train_sentencepiece(corpus, atomic_symbols=data_lib.ARITHMETIC_SYMBOLS)
    else:
        raise ValueError("tokenizer.path is required for tokenizer.kind='hf'")
    for split, examples in (("train", train), ("eval", heldout)):
        for ex in examples:
            n = len(tokenizer.encode(tokenizer.apply_chat_template(ex.model_input)))
            if n > cfg.data.max_prompt_length:
                source = cfg.data.train_path if split == "train" else cfg.data.eval_path
                raise ValueError(
                    f"{source or 'data.source=' + cfg.data.source}: {split} example {ex.index}: "
                    f"prompt has {n} tokens, more than data.max_prompt_length="
                    f"{cfg.data.max_prompt_length}")
    return tokenizer, train, heldout


def sft_warmup(cfg: TrainConfig, policy, tokenizer, train_examples, groups, log) -> None:
    """Supervised warm-up on prompt -> answer + EOS with its own optimizer (RL's Adam state and LR
    schedule start fresh afterwards)."""
    from gspo_megatron.data import sft_samples
    from gspo_megatron.training.batch import make_policy_batch
    from gspo_megatron.training.megatron_setup import OptimConfig, build_optimizer
    from gspo_megatron.training.step import ScoringConfig, train_sft_minibatch

    optimizer, scheduler = build_optimizer(
        policy.model, OptimConfig(lr=cfg.sft.lr, lr_warmup_steps=min(10, cfg.sft.steps),
                                  weight_decay=0.0, clip_grad=1.0), cfg.sft.steps)
    samples = sft_samples(tokenizer, train_examples[: cfg.sft.num_examples or len(train_examples)])
    gen = torch.Generator().manual_seed(cfg.trainer.seed)
    scoring = ScoringConfig(vocab_size=tokenizer.vocab_size)
    tp, cp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.context_parallel_size
    per_rank = cfg.sft.batch_size // groups.dp_size
    for step in range(cfg.sft.steps):
        idx = torch.randint(len(samples), (cfg.sft.batch_size,), generator=gen)
        idx = idx[groups.dp_rank * per_rank:(groups.dp_rank + 1) * per_rank].tolist()
        batch = make_policy_batch(
            [samples[i].input_ids for i in idx], [samples[i].prompt_len for i in idx],
            tokenizer.pad_id, pad_to_multiple_of=tp * (2 * cp if cp > 1 else 1),
            seq_length=cfg.model.seq_length if groups.pp_size > 1 else None)
        for chunk in policy.model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        metrics = train_sft_minibatch(policy.model, batch, min(cfg.trainer.micro_batch_size, per_rank),
                                      scoring, groups)
        optimizer.step()
        scheduler.step(increment=1)
        if step % 50 == 0 or step == cfg.sft.steps - 1:
            log(f"sft step {step}: nll {metrics.get('loss/sft_nll', float('nan')):.4f}")


def prepare(cfg: TrainConfig):
    """Everything that can reject user input, before any compute and without writing anything:
    config validation, reward function, datasets, tokenizer. Returns (reward_fn, tokenizer,
    train examples, held-out examples)."""
    from gspo_megatron.config_loader import validate_config
    from gspo_megatron.rewards import get_reward_fn

    validate_config(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    reward_fn = get_reward_fn(cfg.reward.fn)
    tokenizer, train_examples, eval_examples = setup_tokenizer_and_data(cfg)
    if cfg.model.vocab_size < tokenizer.vocab_size:
        if cfg.model.preset != "tiny":
            raise ValueError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the "
                             f"tokenizer's ({tokenizer.vocab_size})")
        cfg.model.vocab_size = tokenizer.vocab_size
    return reward_fn, tokenizer, train_examples, eval_examples


def run(cfg: TrainConfig, prepared=None) -> dict:
    """Train according to ``cfg``; returns the summary (accuracy before/after, steps)."""
    from gspo_megatron.config_loader import save_config
    from gspo_megatron.data import PromptSampler
    from gspo_megatron.parallel import destroy_distributed, initialize_distributed
    from gspo_megatron.rollout import RolloutEngine
    from gspo_megatron.trainer import REQUEUE_EXIT_CODE, Trainer
    from gspo_megatron.training import checkpoint as ckpt
    from gspo_megatron.training.megatron_setup import build_policy
    from gspo_megatron.training.metrics_log import MetricsLogger
    from gspo_megatron.training.model_io import load_model_weights, save_model_weights

    rank = int(os.environ.get("RANK", "0"))
    reward_fn, tokenizer, train_examples, eval_examples = prepared or prepare(cfg)

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    groups = initialize_distributed(cfg.parallel, cfg.model, seed=cfg.trainer.seed)
    if rank == 0:
        os.makedirs(cfg.logging.run_dir, exist_ok=True)
        save_config(cfg, os.path.join(cfg.logging.run_dir, "config.yaml"))
        tokenizer.save(os.path.join(cfg.logging.run_dir, "tokenizer"))
    policy = build_policy(cfg.model, cfg.parallel, cfg.precision, cfg.optim, groups,
                          total_steps=cfg.trainer.steps * cfg.trainer.num_minibatches)

    save_dir = cfg.checkpoint.save_dir or os.path.join(cfg.logging.run_dir, "checkpoints")
    load_dir = cfg.checkpoint.load_dir or save_dir
    sampler = PromptSampler(train_examples, cfg.rollout.prompts_per_step * groups.dp_size,
                            seed=cfg.trainer.seed)
    start_step = 0
    if ckpt.read_latest(load_dir) is not None:
        state = ckpt.load_checkpoint(policy, load_dir)
        start_step = state.step
        sampler.load_state_dict(state.extra["sampler"])
        log(f"resumed from {load_dir} at step {start_step}")
    elif cfg.checkpoint.init_weights:
        load_model_weights(policy.unwrapped(), cfg.checkpoint.init_weights)

    reference = None
    if cfg.trainer.reference_model:
        from gspo_megatron.training.megatron_setup import copy_weights

        reference = build_policy(cfg.model, cfg.parallel, cfg.precision, cfg.optim, groups,
                                 total_steps=1, with_optimizer=False)
        copy_weights(policy, reference)

    def make_engine(rollout_cfg):
        return RolloutEngine(policy.unwrapped(), groups, eos_id=tokenizer.eos_id,
                             pad_id=tokenizer.pad_id, vocab_size=tokenizer.vocab_size,
                             config=rollout_cfg, tokenizer=tokenizer)

    engine = make_engine(cfg.rollout)
    greedy_engine = make_engine(dataclasses.replace(cfg.rollout, temperature=1.0, top_k=1, top_p=1.0))
    metrics_logger = MetricsLogger(cfg.logging.run_dir, enabled=rank == 0,
                                   progress=cfg.logging.progress,
                                   wandb_project=cfg.logging.wandb_project,
                                   resume_step=start_step - 1)  # a fresh run (-1) starts an empty log
    trainer = Trainer(cfg, groups, policy, tokenizer, sampler, eval_examples, reward_fn, engine,
                      greedy_engine, metrics_logger, reference)
    trainer.step = start_step
    trainer.install_signal_handlers()

    summary: dict = {"start_step": start_step}
    if start_step == 0 and cfg.sft.steps > 0:
        t = time.perf_counter()
        sft_warmup(cfg, policy, tokenizer, train_examples, groups, log)
        summary["sft_s"] = time.perf_counter() - t
        # Reusable as checkpoint.init_weights: RL experiments from the same warm start.
        save_model_weights(policy.unwrapped(), os.path.join(cfg.logging.run_dir, "sft_weights"))
    if eval_examples and start_step == 0:
        summary["accuracy_before"] = trainer.evaluate()
        log(f"held-out accuracy before RL: {summary['accuracy_before']:.3f}")

    def save() -> None:
        t = time.perf_counter()
        ckpt.save_checkpoint(policy, save_dir,
                             ckpt.TrainingState(trainer.step, {"sampler": sampler.state_dict()}),
                             keep_last=cfg.checkpoint.keep_last)
        return time.perf_counter() - t

    exit_code = 0
    while trainer.step < cfg.trainer.steps:
        metrics = trainer.rl_step()
        step = trainer.step - 1
        if cfg.trainer.eval_interval and trainer.step % cfg.trainer.eval_interval == 0 \
                and eval_examples and trainer.step < cfg.trainer.steps:
            metrics["eval/accuracy"] = trainer.evaluate()
        stop = trainer.stop_requested()
        if stop or (cfg.checkpoint.save_interval and trainer.step % cfg.checkpoint.save_interval == 0):
            metrics["perf/checkpoint_s"] = save()
        metrics_logger.log(step, metrics)
        if stop:
            log(f"stop signal: checkpoint at step {trainer.step} written; exiting for requeue")
            exit_code = REQUEUE_EXIT_CODE
            break
    else:
        if cfg.checkpoint.save_interval >= 0 and trainer.step > start_step:
            save()
        if eval_examples:
            summary["accuracy_after"] = trainer.evaluate()
            log(f"held-out accuracy after RL: {summary['accuracy_after']:.3f}")
    summary.update(steps=trainer.step, exit_code=exit_code)
    if rank == 0:
        with open(os.path.join(cfg.logging.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    metrics_logger.close()
    destroy_distributed()
    return summary


def main(argv: list[str] | None = None) -> int:
    """CLI entry. User errors (config, data, reward, checkpoint) exit 2 with one line on stderr and
    no traceback; nothing has been written when they are detected."""
    from gspo_megatron.config_loader import load_config, parse_cli
    from gspo_megatron.trainer import NonFiniteError
    from gspo_megatron.training.checkpoint import CheckpointError

    os.environ.setdefault("TQDM_DISABLE", "1")  # Megatron's static engine draws a progress bar per call
    logging.basicConfig(level=os.environ.get("GSPO_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    try:
        config_path, overrides = parse_cli(sys.argv[1:] if argv is None else argv)
        cfg = load_config(config_path, overrides)
        prepared = prepare(cfg)
    except (ValueError, FileNotFoundError, ImportError) as exc:  # ConfigError, DatasetError too
        print(f"gspo-train: error: {exc}", file=sys.stderr)
        return 2
    try:
        summary = run(cfg, prepared)
    except (CheckpointError, NonFiniteError) as exc:
        print(f"gspo-train: error: {exc}", file=sys.stderr)
        return 2
    return int(summary.get("exit_code", 0))


if __name__ == "__main__":
    sys.exit(main())
