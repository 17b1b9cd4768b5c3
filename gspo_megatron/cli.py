"""``gspo-train [--config recipe.yaml] [--section.field=value ...]``: parse -> validate -> build -> fit.

Without ``--config`` it runs the demo recipe shipped in the package
(``gspo_megatron/config/recipes/demo.yaml``: a tiny MoE on CPU learning the built-in arithmetic
task). Everything that can reject user input runs in :func:`prepare`, before any process group,
model or file exists; :func:`build` makes the components; :meth:`Trainer.fit` runs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import NamedTuple

from gspo_megatron.config import TrainConfig

logger = logging.getLogger("gspo_megatron")


class Prepared(NamedTuple):
    """What :func:`prepare` checked and loaded (no compute, nothing written)."""

    reward_fn: object
    tokenizer: object
    train: list
    eval: list


def load_data(cfg: TrainConfig):
    """Tokenizer, training examples and held-out examples for ``cfg.data``; prompts longer than
    ``data.max_prompt_length`` tokens are refused."""
    from gspo_megatron import data as data_lib
    from gspo_megatron.tokenizer import build_tokenizer, train_sentencepiece

    if cfg.data.source == "arithmetic":
        train, heldout = data_lib.make_arithmetic_splits(
            cfg.data.num_train_examples, cfg.data.num_eval_examples, seed=cfg.trainer.seed,
            max_operand=cfg.data.max_operand, heldout_fraction=cfg.data.heldout_fraction)
    else:
        keys = dict(prompt_key=cfg.data.prompt_key, answer_key=cfg.data.answer_key)
        train = data_lib.load_prompt_dataset(cfg.data.train_path, **keys)
        heldout = data_lib.load_prompt_dataset(cfg.data.eval_path, **keys) if cfg.data.eval_path else []

    if cfg.tokenizer.path:
        tokenizer = build_tokenizer(cfg.tokenizer.kind, cfg.tokenizer.path)
    else:
        # Trained in-process on the task's text (deterministic); every rank trains the same one,
        # so no rank waits on a file. Saved with the run once everything has been validated.
        corpus = data_lib.arithmetic_tokenizer_corpus(train + heldout)
        tokenizer = train_sentencepiece(corpus, atomic_symbols=data_lib.ARITHMETIC_SYMBOLS)
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


def prepare(cfg: TrainConfig) -> Prepared:
    """Everything that can reject user input, before any compute and without writing anything:
    the megatron-core version, config validation, reward function, datasets, tokenizer."""
    from gspo_megatron.compat import check_megatron_version
    from gspo_megatron.config.validation import validate_config
    from gspo_megatron.rewards import get_reward_fn

    check_megatron_version()
    validate_config(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    reward_fn = get_reward_fn(cfg.reward.fn)
    tokenizer, train, heldout = load_data(cfg)
    if cfg.model.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the "
                         f"tokenizer's vocabulary ({tokenizer.vocab_size})")
    return Prepared(reward_fn, tokenizer, train, heldout)


def build(cfg: TrainConfig, prepared: Prepared, faults=None):
    """Process groups, the run directory (config and tokenizer), the policy (and the frozen
    reference), the rollout engines and the :class:`~gspo_megatron.trainer.Trainer`."""
    from gspo_megatron.backends.megatron.parallel import initialize_distributed
    from gspo_megatron.backends.megatron.policy import build_policy
    from gspo_megatron.backends.megatron.rollout import RolloutEngine
    from gspo_megatron.config.loader import save_config
    from gspo_megatron.data import PromptSampler
    from gspo_megatron.trainer import Trainer

    tokenizer = prepared.tokenizer
    groups = initialize_distributed(cfg.parallel, cfg.model, seed=cfg.trainer.seed)
    if groups.is_logging_rank:
        os.makedirs(cfg.logging.run_dir, exist_ok=True)
        save_config(cfg, os.path.join(cfg.logging.run_dir, "config.yaml"))
        tokenizer.save(os.path.join(cfg.logging.run_dir, "tokenizer"))

    def policy(**kwargs):
        return build_policy(cfg.model, cfg.parallel, cfg.precision, cfg.optim, groups,
                            micro_batch_size=cfg.trainer.micro_batch_size,
                            vocab_size=tokenizer.vocab_size, **kwargs)

    actor = policy(total_steps=cfg.trainer.steps * cfg.trainer.num_minibatches)
    reference = policy(total_steps=1, with_optimizer=False) if cfg.trainer.reference_model else None
    sampler = PromptSampler(prepared.train, cfg.rollout.prompts_per_step * groups.dp_size,
                            seed=cfg.trainer.seed)

    sampling = RolloutEngine(actor.unwrapped(), groups, eos_id=tokenizer.eos_id,
                             pad_id=tokenizer.pad_id, vocab_size=tokenizer.vocab_size,
                             config=cfg.rollout, tokenizer=tokenizer, backend=cfg.rollout.engine,
                             dynamic_buffer_size_gb=cfg.rollout.dynamic_buffer_size_gb)
    # Greedy evaluation shares the engine and its KV cache.
    greedy = sampling.with_sampling(
        dataclasses.replace(cfg.rollout, temperature=1.0, top_k=1, top_p=1.0))
    return Trainer(cfg, groups, actor, tokenizer, sampler,
                   {"train": prepared.train, "eval": prepared.eval}, prepared.reward_fn,
                   sampling, greedy, reference=reference, faults=faults)


def main(argv: list[str] | None = None) -> int:
    """CLI entry. User errors (config, data, reward, checkpoint) exit 2 with one line on stderr and
    no traceback; nothing has been written when they are detected."""
    from gspo_megatron.backends.megatron.checkpoint import CheckpointError
    from gspo_megatron.backends.megatron.parallel import destroy_distributed
    from gspo_megatron.compat import UnsupportedMegatronError
    from gspo_megatron.config import DEMO_RECIPE
    from gspo_megatron.config.loader import load_config, parse_cli
    from gspo_megatron.faults import FaultInjector
    from gspo_megatron.trainer import NonFiniteError

    os.environ.setdefault("TQDM_DISABLE", "1")  # Megatron's static engine draws a progress bar per call
    logging.basicConfig(level=os.environ.get("GSPO_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    try:
        config_path, overrides = parse_cli(sys.argv[1:] if argv is None else argv)
        cfg = load_config(config_path or DEMO_RECIPE, overrides)
        faults = FaultInjector.from_env()
        prepared = prepare(cfg)
    except (ValueError, FileNotFoundError, ImportError, UnsupportedMegatronError) as exc:
        print(f"gspo-train: error: {exc}", file=sys.stderr)
        return 2
    try:
        summary = build(cfg, prepared, faults).fit()
    except (CheckpointError, NonFiniteError) as exc:
        print(f"gspo-train: error: {exc}", file=sys.stderr)
        return 2
    finally:
        destroy_distributed()
    return int(summary.get("exit_code", 0))


if __name__ == "__main__":
    sys.exit(main())
