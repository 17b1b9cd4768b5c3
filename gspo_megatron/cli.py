"""``gspo-train [--config recipe.yaml] [--section.field=value ...]``: parse -> validate -> build -> fit.

Without ``--config`` it runs the demo recipe shipped in the package
(``gspo_megatron/config/recipes/demo.yaml``: a tiny MoE on CPU learning the built-in arithmetic
task). Everything that can reject user input runs in :func:`prepare`, before any process group,
model or file exists; :func:`build` makes the components; :meth:`Trainer.fit` runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import warnings
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # only annotations: importing this module (as a spawned worker's re-imported
    from gspo_megatron.config import TrainConfig  # main module does) imports no torch

logger = logging.getLogger("gspo_megatron")


class Prepared(NamedTuple):
    """What :func:`prepare` checked and loaded (no compute, nothing written)."""

    reward_fn: object
    tokenizer: object
    train: list
    eval: list
    reward_search_dirs: list


def load_data(cfg: TrainConfig):
    """Tokenizer, training examples and held-out examples for ``cfg.data``; prompts longer than
    ``data.max_prompt_length`` tokens are refused."""
    train, heldout = load_examples(cfg)
    tokenizer = load_tokenizer(cfg, train, heldout)
    check_prompt_lengths(cfg, tokenizer, train, heldout)
    return tokenizer, train, heldout


def load_examples(cfg: TrainConfig) -> tuple[list, list]:
    """The training and held-out examples of ``cfg.data`` (a file's, or the built-in task's)."""
    from gspo_megatron import data as data_lib

    if cfg.data.source != "file":
        return _arithmetic_splits(cfg)
    keys = dict(prompt_key=cfg.data.prompt_key, answer_key=cfg.data.answer_key)
    train = data_lib.load_prompt_dataset(cfg.data.train_path, **keys)
    heldout = data_lib.load_prompt_dataset(cfg.data.eval_path, **keys) if cfg.data.eval_path else []
    return train, heldout


def load_tokenizer(cfg: TrainConfig, train: list, heldout: list):
    """``tokenizer.path``'s tokenizer, else one trained on the examples' text."""
    from gspo_megatron import data as data_lib
    from gspo_megatron.tokenizer import build_tokenizer, train_sentencepiece

    if cfg.tokenizer.path:
        options = ({"chat_template_kwargs": cfg.tokenizer.chat_template_kwargs}
                   if cfg.tokenizer.chat_template_kwargs else {})
        try:
            return build_tokenizer(cfg.tokenizer.kind, cfg.tokenizer.path, **options)
        except (FileNotFoundError, ValueError) as e:  # the field to fix, in the one line
            raise type(e)(f"tokenizer.path={cfg.tokenizer.path!r} (tokenizer.kind="
                          f"{cfg.tokenizer.kind!r}): {e}") from None
    # Trained in-process on the task's text (deterministic); every rank trains the same one,
    # so no rank waits on a file. Saved with the run once everything has been validated.
    corpus = data_lib.arithmetic_tokenizer_corpus(train + heldout)
    symbols = data_lib.ARITHMETIC_SYMBOLS
    from gspo_megatron.envs.workers import BUILTIN_ENVS, resolve_env_class

    if cfg.multi_turn.env in BUILTIN_ENVS:  # a built-in environment's tool calls and chat roles
        env = resolve_env_class(cfg.multi_turn.env)
        corpus = corpus + list(getattr(env, "TOKENIZER_TEXT", ()))
        symbols = symbols + tuple(getattr(env, "TOKENIZER_SYMBOLS", ()))
    return train_sentencepiece(corpus, atomic_symbols=symbols)


def check_prompt_lengths(cfg: TrainConfig, tokenizer, train: list, heldout: list) -> None:
    """Refuse the first prompt longer than ``data.max_prompt_length`` tokens, naming it."""
    for split, examples in (("train", train), ("eval", heldout)):
        for ex in examples:
            n = len(tokenizer.encode(tokenizer.apply_chat_template(ex.model_input)))
            if n > cfg.data.max_prompt_length:
                # A file's example is named as its load errors name it (file:line); a generated
                # one by its 1-based number and its text.
                where = ex.where or (f"data.source={cfg.data.source}: {split} example "
                                     f"{ex.index + 1} ({ex.prompt!r})")
                raise ValueError(f"{where}: prompt has {n} tokens, more than "
                                 f"data.max_prompt_length={cfg.data.max_prompt_length}")


def _arithmetic_splits(cfg: TrainConfig) -> tuple[list, list]:
    """The built-in task's training and held-out sets; a size the task cannot draw is refused
    naming the field that asked for it."""
    from gspo_megatron import data as data_lib

    d = cfg.data
    seed = cfg.trainer.seed if d.seed is None else d.seed
    splits = []
    for field, split, count in (("data.num_train_examples", "train", d.num_train_examples),
                                ("data.num_eval_examples", "heldout", d.num_eval_examples)):
        try:
            if d.source == "arithmetic_chain":
                splits.append(data_lib.make_chain_dataset(
                    count, seed=seed, split=split, num_operands=d.chain_operands,
                    max_operand=d.max_operand, heldout_fraction=d.heldout_fraction))
            else:
                splits.append(data_lib.make_arithmetic_dataset(
                    count, seed=seed, split=split, max_operand=d.max_operand,
                    heldout_fraction=d.heldout_fraction))
        except ValueError as e:  # "... has only N; <advice for Python callers>"
            raise ValueError(f"{field}={count}: {str(e).split(';')[0]} (data.max_operand="
                             f"{d.max_operand}, data.heldout_fraction={d.heldout_fraction}); "
                             f"lower {field} or raise data.max_operand") from None
    return splits[0], splits[1]


def check_data_sizes(cfg: TrainConfig, train: list, heldout: list, dp_size: int) -> None:
    """One RL step draws ``rollout.prompts_per_step`` prompts on each of ``dp_size`` data-parallel
    ranks, and evaluation gives every rank a share of the held-out set: refuse datasets too small
    for that here, rather than when the sampler or the evaluator is built after the run directory
    has been written."""
    d, per_step = cfg.data, cfg.rollout.prompts_per_step
    if d.source == "file":
        train_name = f"data.train_path: {d.train_path} has"
        eval_name = f"data.eval_path: {d.eval_path} has"
    else:
        train_name, eval_name = "data.num_train_examples:", "data.num_eval_examples:"
    need = per_step * dp_size
    if len(train) < need:
        raise ValueError(f"{train_name} {len(train)} prompts, fewer than one RL step needs "
                         f"(rollout.prompts_per_step x data-parallel size = {per_step} x "
                         f"{dp_size} = {need})")
    if 0 < len(heldout) < dp_size:
        raise ValueError(f"{eval_name} {len(heldout)} held-out prompts, fewer than the "
                         f"data-parallel size {dp_size} (each data-parallel rank evaluates a "
                         "share of them)")


def rl_optimizer_steps(cfg: TrainConfig) -> int:
    """Optimiser steps of the RL run: what its LR schedule spans when ``optim.lr_decay_steps`` is
    null."""
    return cfg.trainer.steps * cfg.trainer.num_minibatches


def schedule_problem(cfg: TrainConfig, checkpoint_dir: str) -> str | None:
    """Why this config's LR schedule is not the one the checkpoint ``checkpoint_dir`` was trained
    on (megatron-core would keep the checkpoint's without a word), or None."""
    from gspo_megatron.backends.megatron import checkpoint as ckpt
    from gspo_megatron.backends.megatron.policy import lr_schedule

    found = ckpt.schedule_mismatch(checkpoint_dir, lr_schedule(cfg.optim, rl_optimizer_steps(cfg)))
    if found is None:
        return None
    key, here, saved = found
    field = {"max_lr": "optim.lr", "min_lr": "optim.min_lr",
             "lr_warmup_steps": "optim.lr_warmup_steps", "lr_decay_style": "optim.lr_decay_style",
             "start_wd": "optim.weight_decay", "end_wd": "optim.weight_decay"}.get(key)
    if field is None:  # lr_decay_steps
        field = ("optim.lr_decay_steps" if cfg.optim.lr_decay_steps else
                 f"optim.lr_decay_steps (null: trainer.steps {cfg.trainer.steps} x "
                 f"trainer.num_minibatches {cfg.trainer.num_minibatches})")
    return (f"{checkpoint_dir}: the LR schedule differs from the checkpoint's: {key} {here} from "
            f"{field}, {saved} in the checkpoint; resume with the run's settings, or set "
            "optim.override_opt_param_scheduler=true to follow this config's schedule")


def check_start_weights(cfg: TrainConfig) -> None:
    """The weights the run will start from fit the model: the checkpoint it resumes (the load
    directory's tracker must name a loadable iteration), else ``checkpoint.init_weights`` (it must
    be a checkpoint with the model's shapes). Read-only: tracker file and tensor metadata only, so
    a bad one is refused before the run directory is written (it used to fail after, behind a page
    of warnings)."""
    from gspo_megatron.backends.megatron import checkpoint as ckpt
    from gspo_megatron.config.paths import resume_dir_of
    from gspo_megatron.rollouts.source import check_resumable

    field, load_dir = resume_dir_of(cfg)
    try:
        resume = ckpt.resume_dir(load_dir)
    except ckpt.CheckpointError as e:
        raise ckpt.CheckpointError(f"cannot resume ({field}): {e}") from None
    if resume is not None:
        try:  # what the checkpoint has in flight, and whether this placement can take it over
            check_resumable(ckpt.read_rank_state(resume, 0, cfg.checkpoint.allow_pickle),
                            cfg.rollout.placement, cfg.rollout.partial_rollouts)
        except (ValueError, ckpt.CheckpointError) as e:
            raise ckpt.CheckpointError(f"cannot resume ({field}): {resume}: {e}") from None
        try:
            problem = ckpt.weights_mismatch(resume, cfg.model)
        except ckpt.CheckpointError:
            return  # unreadable: the resume falls back to an older checkpoint, or says why not
        if problem:
            raise ckpt.CheckpointError(f"cannot resume ({field}): {problem}")
        if not cfg.optim.override_opt_param_scheduler:
            problem = schedule_problem(cfg, resume)
            if problem:
                raise ckpt.CheckpointError(f"cannot resume ({field}): {problem}")
    elif cfg.checkpoint.init_weights:
        try:
            problem = ckpt.weights_mismatch(cfg.checkpoint.init_weights, cfg.model)
        except ckpt.CheckpointError as e:
            problem = str(e)
        if problem:
            raise ckpt.CheckpointError(f"checkpoint.init_weights: {problem}")


def prepare(cfg: TrainConfig, recipe_dir: str | None = None) -> Prepared:
    """Everything that can reject user input, before any compute and without writing anything:
    the megatron-core version, config validation, the directories the run writes, reward
    function, datasets (and their sizes against the batch), tokenizer, and the checkpoint the run
    starts from."""
    from gspo_megatron.compat import check_megatron_version
    from gspo_megatron.config.paths import output_dir_problems
    from gspo_megatron.config.validation import ConfigError, validate_config
    from gspo_megatron.rewards import get_reward_fn

    check_megatron_version()
    search = [recipe_dir] if recipe_dir else []  # a reward module next to the recipe
    dp_size = validate_config(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")),
                              reward_search_dirs=search)
    problems = output_dir_problems(cfg)
    if problems:
        raise ConfigError(problems)
    if cfg.reward.fns is None:
        reward_fn = get_reward_fn(cfg.reward.fn, search)
    else:  # a mix: its reward model (if named) is loaded in build()
        from gspo_megatron.rewards.reward_model import REWARD_MODEL, RewardMix

        reward_fn = RewardMix([(name, None if name == REWARD_MODEL else get_reward_fn(name, search),
                                float(weight)) for name, weight in cfg.reward.fns.items()])
    tokenizer, train, heldout = load_data(cfg)
    if cfg.model.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the "
                         f"tokenizer's vocabulary ({tokenizer.vocab_size})")
    check_data_sizes(cfg, train, heldout, dp_size)
    check_start_weights(cfg)
    return Prepared(reward_fn, tokenizer, train, heldout, search)


def build(cfg: TrainConfig, prepared: Prepared, faults=None, placement=None, bridge=None):
    """Process groups, the run directory (config and tokenizer), the policy (and the frozen
    reference), the rollout engine and what runs them: a
    :class:`~gspo_megatron.trainer.Trainer` whose rollouts come from this process
    (:class:`~gspo_megatron.rollouts.source.LocalRollouts`) or, under ``rollout.placement:
    separate`` (``placement``, ``bridge``: :mod:`gspo_megatron.rollouts.remote`), from the
    rollout ranks (:class:`~gspo_megatron.rollouts.remote.RemoteRollouts`); on a rollout rank a
    :class:`~gspo_megatron.rollouts.remote.RolloutServer` over a full replica of the policy
    without optimizer (its weights come from the trainer ranks)."""
    from gspo_megatron.backends.megatron.checkpoint_writer import start_write_results_server
    from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine
    from gspo_megatron.backends.megatron.parallel import initialize_distributed
    from gspo_megatron.backends.megatron.policy import build_policy
    from gspo_megatron.config import token_budget
    from gspo_megatron.config.loader import save_config
    from gspo_megatron.config.model import ParallelConfig
    from gspo_megatron.data import PromptSampler
    from gspo_megatron.faults import FaultInjector
    from gspo_megatron.rewards.workers import start_reward_workers
    from gspo_megatron.rollouts.remote import RemoteRollouts, RolloutServer
    from gspo_megatron.rollouts.sampling import StepSampler
    from gspo_megatron.task import Task
    from gspo_megatron.trainer import Trainer

    tokenizer = prepared.tokenizer
    faults = faults or FaultInjector()
    rollout_rank = placement is not None and placement.is_rollout
    parallel = ParallelConfig() if rollout_rank else cfg.parallel
    if not rollout_rank:  # before anything large is allocated (its docstring says why)
        start_write_results_server()
    groups = initialize_distributed(parallel, cfg.model, seed=cfg.trainer.seed)
    if groups.is_logging_rank and not rollout_rank:
        os.makedirs(cfg.logging.run_dir, exist_ok=True)
        save_config(cfg, os.path.join(cfg.logging.run_dir, "config.yaml"))
        tokenizer.save(os.path.join(cfg.logging.run_dir, "tokenizer"))

    # The layer spec, chosen (and logged) once for every model of the run: the policy, the
    # reference and a rollout rank's replica share weights by name, so they share the spec. The
    # rollout's layout decides whether its decoding can take TE: a rollout rank's is TP = PP = 1.
    from gspo_megatron.backends.megatron.kernels.decode import step_function_applies
    from gspo_megatron.backends.megatron.model import resolve_transformer_impl

    separate = cfg.rollout.placement == "separate"
    precision = dataclasses.replace(cfg.precision, transformer_impl=resolve_transformer_impl(
        cfg.precision, log=groups.is_logging_rank and not rollout_rank,  # one line per job
        decode_step_function=step_function_applies(
            cfg.rollout, 1 if separate else cfg.parallel.tensor_model_parallel_size,
            1 if separate else cfg.parallel.pipeline_model_parallel_size)))

    def policy(**kwargs):
        return build_policy(cfg.model, parallel, precision, cfg.optim, groups,
                            micro_batch_size=cfg.trainer.micro_batch_size,
                            logprob_micro_batch_size=cfg.trainer.logprob_micro_batch_size,
                            max_tokens_per_microbatch=token_budget(cfg),
                            vocab_size=tokenizer.vocab_size, **kwargs)

    if rollout_rank:
        actor = policy(total_steps=1, with_optimizer=False, frozen=True)
    else:
        actor = policy(total_steps=rl_optimizer_steps(cfg),
                       routing_cfg=cfg.routing, offload=cfg.trainer.offload)
    reference = (policy(total_steps=1, with_optimizer=False, frozen=True)
                 if cfg.trainer.reference_model and not rollout_rank else None)
    sampler = PromptSampler(prepared.train, cfg.rollout.prompts_per_step * groups.dp_size,
                            seed=cfg.trainer.seed)
    engine = RolloutEngine(actor.unwrapped(), groups, eos_id=tokenizer.eos_id,
                           pad_id=tokenizer.pad_id, vocab_size=tokenizer.vocab_size,
                           config=cfg.rollout, record_routes=cfg.routing.records_rollout_routes)
    workers = None
    if cfg.reward.fns is None:
        workers = start_reward_workers(cfg.reward.fn, prepared.reward_fn, cfg.reward.num_workers,
                                       cfg.reward.timeout_s, prepared.reward_search_dirs)
    elif any(fn is None for _, fn, _ in prepared.reward_fn.components):
        from gspo_megatron.rewards.reward_model import RewardModelWorker

        rm = cfg.reward_model
        prepared.reward_fn.scorer = RewardModelWorker(rm.path, rm.batch_size, rm.max_length,
                                                      rm.device, rm.timeout_s).start()
    episodes = None
    if cfg.multi_turn.enabled:
        from gspo_megatron.envs.turns import Episodes
        from gspo_megatron.envs.workers import resolve_env_class, start_envs

        mt = cfg.multi_turn
        episodes = Episodes(start_envs(mt.env, mt.num_workers, mt.timeout_s,
                                       prepared.reward_search_dirs),
                            tokenizer, mt.max_turns, mt.max_turn_tokens, mt.max_message_chars,
                            budget=cfg.rollout.max_new_tokens,
                            env_cls=resolve_env_class(mt.env, prepared.reward_search_dirs))
    task = Task(tokenizer, sampler, prepared.train, prepared.eval, prepared.reward_fn, workers,
                episodes)
    if rollout_rank:
        return RolloutServer(bridge, StepSampler(cfg, groups, engine, task, faults),
                             actor.load_weight_pieces, cfg.rollout.max_staleness,
                             cfg.trainer.steps, cfg.trainer.gc_freeze)
    rollouts = (RemoteRollouts(bridge, placement, groups, sampler, cfg.rollout.max_staleness,
                               cfg.trainer.steps, cfg.rollout.weight_bucket_bytes())
                if placement is not None else None)
    return Trainer(cfg, groups, actor, engine, task, reference=reference, faults=faults,
                   rollouts=rollouts)


@contextlib.contextmanager
def third_party_warnings(verbose: bool):
    """Hide, for the ``with`` block, the Python warnings and the Megatron / Apex / Transformer
    Engine / huggingface_hub log records below ERROR that are not gspo_megatron's own: the
    fallback notices every start-up prints (and the Hub client's retries) would drown the one
    line a refused input gets. ``--verbose``
    (or any ``-W`` / ``PYTHONWARNINGS`` setting, which the user chose) shows them. Filters and
    levels are restored on exit, so calling :func:`main` in-process leaves no trace."""
    loggers = [logging.getLogger(name)
               for name in ("megatron", "apex", "transformer_engine", "huggingface_hub")]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        if not verbose and not sys.warnoptions:
            from gspo_megatron.config.validation import ConfigWarning

            warnings.filterwarnings("ignore")
            warnings.filterwarnings("default", module=r"gspo_megatron(\.|$)")
            warnings.filterwarnings("default", category=ConfigWarning)
            for lg in loggers:
                lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)


def _user_error(exc: BaseException) -> int:
    print(f"gspo-train: error: {exc}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """CLI entry. User errors (config, data, reward, checkpoint) exit 2 with one line on stderr and
    no traceback; nothing has been written when they are detected. Third-party warnings are shown
    only with ``--verbose``."""
    from gspo_megatron.config.loader import parse_command_line

    os.environ.setdefault("TQDM_DISABLE", "1")  # Megatron's static engine draws a progress bar per call
    logging.basicConfig(level=os.environ.get("GSPO_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    try:
        args = parse_command_line(sys.argv[1:] if argv is None else argv)
    except ValueError as exc:
        return _user_error(exc)
    with third_party_warnings(args.verbose):
        return _run(args)


def _run(args) -> int:
    """Load, prepare, build and fit the run ``args`` (a ``CommandLine``) describes."""
    from gspo_megatron.backends.megatron.checkpoint import CheckpointError
    from gspo_megatron.backends.megatron.parallel import destroy_distributed
    from gspo_megatron.compat import UnsupportedMegatronError
    from gspo_megatron.config import DEMO_RECIPE
    from gspo_megatron.config.loader import load_config
    from gspo_megatron.faults import FaultInjector
    from gspo_megatron.rollouts.remote import PeerLost, RolloutServer
    from gspo_megatron.trainer import NonFiniteError

    if args.check:
        return _check(args)
    try:
        cfg = load_config(args.config or DEMO_RECIPE, args.overrides)
        faults = FaultInjector.from_env()
        prepared = prepare(cfg, os.path.dirname(os.path.abspath(args.config))
                           if args.config else None)
    except (ValueError, FileNotFoundError, ImportError, UnsupportedMegatronError,
            CheckpointError) as exc:
        return _user_error(exc)
    trainer = placement = bridge = None
    try:
        if cfg.rollout.placement == "separate":  # the rollout ranks and the trainer ranks
            from gspo_megatron.rollouts.remote import Placement, start_sides

            placement = Placement(int(os.environ.get("RANK", "0")),
                                  int(os.environ.get("WORLD_SIZE", "1")), cfg.rollout.ranks)
            bridge = start_sides(placement)
        built = build(cfg, prepared, faults, placement, bridge)
        if isinstance(built, RolloutServer):  # a rollout rank of rollout.placement: separate
            try:
                built.serve()
            finally:
                built.close()
            return 0
        trainer = built
        summary = trainer.fit()
    except (CheckpointError, NonFiniteError) as exc:
        return _user_error(exc)
    except PeerLost as exc:  # the other side of rollout.placement: separate died: one line
        print(f"gspo-train: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if trainer is not None:
            trainer.close()
        destroy_distributed()
    exit_code = int(summary.get("exit_code", 0))
    if cfg.checkpoint.export_hf and exit_code == 0 and int(os.environ.get("RANK", "0")) == 0:
        from gspo_megatron.config.paths import save_dir_of
        from gspo_megatron.tools.export_hf import export_in_subprocess

        try:
            export_in_subprocess(save_dir_of(cfg)[1], cfg.checkpoint.export_hf)
        except RuntimeError as exc:  # the run itself succeeded: its checkpoint is intact
            print(f"gspo-train: error: {exc}", file=sys.stderr)
            return 1
        print(f"exported the final policy to {cfg.checkpoint.export_hf}", flush=True)
    return exit_code


def _check(args) -> int:
    """``--check``: every check :mod:`gspo_megatron.check` runs, each problem on one line (stderr),
    then one verdict; 0 when there is none, else 2. Nothing is written."""
    from gspo_megatron.check import check_run
    from gspo_megatron.config import DEMO_RECIPE
    from gspo_megatron.config.loader import load_config

    recipe = args.config or DEMO_RECIPE
    try:
        cfg = load_config(recipe, args.overrides)
    except (ValueError, FileNotFoundError) as exc:
        return _user_error(exc)
    try:
        gpu_memory = float(os.environ.get("GPU_MEMORY_GIB", "80"))
    except ValueError:
        return _user_error(f"GPU_MEMORY_GIB must be a number of GiB, got "
                           f"{os.environ['GPU_MEMORY_GIB']!r}")
    problems = check_run(cfg, recipe, args.overrides,
                         os.path.dirname(os.path.abspath(args.config)) if args.config else None,
                         args.gpus, gpu_memory, say=lambda line: print(f"check: {line}"))
    for problem in problems:
        print(f"gspo-train: error: {problem}", file=sys.stderr)
    if problems:
        print(f"gspo-train --check: {len(problems)} problem(s) in {recipe}", file=sys.stderr)
        return 2
    print(f"gspo-train --check: ok ({recipe})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
