"""Table of bad inputs a user can hand us: each is rejected before compute with a message that
names the field, file or line."""

import json
import math
import os
import time

import pytest
import torch

from gspo_megatron.algorithms import LOSSES
from gspo_megatron.config.loader import DEMO_RECIPE, ConfigError, load_config, validate_config
from gspo_megatron.data import DatasetError, load_prompt_dataset
from gspo_megatron.rewards import compute_rewards, get_reward_fn


TINY_RECIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "examples", "configs", "tiny_gspo.yaml")


def _config(tmp_path, text):
    """A recipe with ``text``; the demo recipe (a valid run) when ``text`` is empty."""
    if not text:
        return DEMO_RECIPE
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


CONFIG_CASES = [
    # (yaml text, overrides, world size, message regex)
    ("rollout:\n  group_szie: 4\n", [], 1, r"recipe.yaml:2: rollout.group_szie: unknown field; did you mean 'group_size'"),
    ("rolout:\n  group_size: 4\n", [], 1, r"rolout.*unknown section"),
    ("rollout:\n  group_size: four\n", [], 1, r"rollout.group_size"),
    ("loss:\n  variant: gpso\n", [], 1, r"loss.variant.*'gpso'"),
    ("optim:\n  lr: -1\n", [], 1, r"recipe.yaml:2: optim.lr: must be > 0, got -1.0$"),
    ("model:\n  preset: qwen9\n", [], 1, r"model.preset"),
    ("", ["--rollout.temperature=0"], 1, r"rollout.temperature"),
    ("", ["--rollout.top_p=1.5"], 1, r"rollout.top_p"),
    ("rollout:\n  group_size: 8\n  top_p: 1.5\n", [], 1, r"recipe.yaml:3: rollout.top_p: must be in \(0, 1\], got 1.5$"),
    ("", ["--loss.variant=GSPO"], 1, r"loss.variant: expected one of .*, got 'GSPO'; did you mean 'gspo'\?$"),
    ("", ["--rollout.temperature=0.0", "--rollout.top_k=1"], 1, r"rollout.temperature: must be > 0 \(greedy decoding is rollout.top_k: 1\)"),
    ("", ["--rollout.top_k=20", "--rollout.top_p=0.95"], 1, r"rollout.top_k and rollout.top_p cannot both be active"),
    ("loss:\n  clip_low: 2\n", [], 1, r"recipe.yaml:2: loss.clip_low: must be < 1"),
    ("loss:\n  clip_high: -1\n", [], 1, r"^[^ ]*recipe.yaml:2: loss.clip_high: must be >= 0, got -1.0$"),
    ("", ["--loss.clip_low=2"], 1, r"^override '--loss.clip_low=2': loss.clip_low: must be < 1 \(lower bound 1 - clip_low > 0\), got 2.0$"),
    ("", ["--loss.aggregation=token_mean"], 1, r"^override '--loss.aggregation=token_mean': loss.aggregation: 'token_mean' is not an aggregation of variant='gspo'; it takes 'seq_mean_token_mean', 'seq_mean_token_sum' \(default 'seq_mean_token_mean'\)$"),
    ("model:\n  preset: tiny\n", [], 1, r"model.seq_length \(64\) must be >= data.max_prompt_length \+ rollout.max_new_tokens = 1024 \+ 1024"),
    ("", ["--rollout.group_size=1"], 1, r"rollout.group_size"),
    ("", ["--trainer.num_minibatches=3"], 1, r"trainer.num_minibatches"),
    ("", ["--trainer.micro_batch_size=7", "--trainer.pack_sequences=false"], 1,
     r"trainer.micro_batch_size"),
    ("", ["--loss.kl_coef=0.1"], 1, r"loss.kl_coef"),
    ("", ["--data.source=file"], 1, r"data.train_path"),
    ("", ["--data.source=file", "--data.train_path=/nonexistent/p.jsonl"], 1, r"/nonexistent/p.jsonl"),
    ("", ["--model.seq_length=8"], 1, r"model.seq_length"),
    ("", ["--parallel.expert_model_parallel_size=3"], 3, r"num_moe_experts .4. is not divisible by parallel.expert_model_parallel_size .3."),
    ("", ["--parallel.tensor_model_parallel_size=3"], 3, r"num_attention_heads .4. is not divisible by parallel.tensor_model_parallel_size .3."),
    ("", ["--parallel.tensor_model_parallel_size=2"], 3, r"world size 3 is not divisible"),
    ("", ["--reward.fn=no_such_reward"], 1, r"no_such_reward"),
    ("", ["--checkpoint.keep_last=0"], 1, r"checkpoint.keep_last"),
    # context parallel: rows that do not cut into 2 x CP chunks, a budget below a rounded
    # sequence, and what does not shard yet
    ("", ["--parallel.context_parallel_size=2", "--model.seq_length=66"], 2, r"model.seq_length \(66\) must be divisible by TP x 2 x CP so sequence/context sharding is even"),
    # (packed under CP: every sequence rounded up to 2 x CP, so 17 tokens take 20)
    ("", ["--parallel.context_parallel_size=2", "--data.max_prompt_length=9", "--rollout.max_new_tokens=8", "--trainer.max_tokens_per_microbatch=18"], 2, r"trainer.max_tokens_per_microbatch=18 cannot hold the longest sequence the recipe allows: data.max_prompt_length \+ rollout.max_new_tokens = 9 \+ 8 = 17 \(rounded up to a multiple of 4: TP under sequence parallel x 2 CP\)$"),
    ("", ["--parallel.context_parallel_size=2", "--rollout.engine=static"], 2, r"parallel.context_parallel_size=2 with rollout.engine='static'"),
    ("", ["--trainer.max_consecutive_faults=0"], 1, r"trainer.max_consecutive_faults"),
    # rollouts on their own ranks: a negative lag, no rollout rank, no trainer rank, rollout
    # ranks that do not match the trainer's data-parallel ranks
    ("", ["--rollout.max_staleness=-1"], 1, r"rollout.max_staleness: must be >= 0, got -1$"),
    ("", ["--rollout.placement=separate"], 2, r"rollout.ranks: must be >= 1 with rollout.placement='separate', got 0$"),
    ("", ["--rollout.placement=separate", "--rollout.ranks=2"], 2, r"rollout.ranks=2 with rollout.placement='separate' leaves no rank to train in a job of 2 ranks$"),
    ("", ["--rollout.placement=separate", "--rollout.ranks=1"], 3, r"rollout.ranks=1 must equal the trainer's data-parallel size \(2: 2 training ranks / TP x PP x CP\)"),
    # packing: a budget below the longest sequence the recipe allows, or none at all; an attention
    # kernel that cannot pack; routes of sequence-parallel shards of a packed row
    ("", ["--trainer.max_tokens_per_microbatch=0"], 1, r"trainer.max_tokens_per_microbatch: must be >= 1, got 0"),
    ("", ["--trainer.logprob_micro_batch_size=0"], 1, r"trainer.logprob_micro_batch_size: must be >= 1, got 0"),
    ("", ["--trainer.max_tokens_per_microbatch=10"], 1, r"trainer.max_tokens_per_microbatch=10 cannot hold the longest sequence the recipe allows: data.max_prompt_length \+ rollout.max_new_tokens = \d+ \+ \d+ = \d+$"),
    ("", ["--trainer.max_tokens_per_microbatch=16", "--trainer.logprob_micro_batch_size=8"], 1, r"trainer.logprob_micro_batch_size=8 scales trainer.max_tokens_per_microbatch=16 to 8 tokens for the log-prob passes, which cannot hold the longest sequence \(\d+\); raise it to at least trainer.micro_batch_size=16$"),
    ("", ["--trainer.max_tokens_per_microbatch=256", "--precision.transformer_impl=local", "--precision.local_kernels=false"], 1, r"trainer.max_tokens_per_microbatch=256 needs an attention kernel that packs: precision.local_kernels=false"),
    ("", ["--trainer.max_tokens_per_microbatch=256", "--routing.replay=r2", "--parallel.tensor_model_parallel_size=2"], 2, r"trainer.max_tokens_per_microbatch=256 with routing replay/diagnostics needs parallel.tensor_model_parallel_size=1, got 2"),
    # zero mismatch: layouts whose rollout and training forward cannot share one order of sums
    ("", ["--precision.batch_invariant=true", "--parallel.tensor_model_parallel_size=2"], 2, r"precision.batch_invariant needs the local kernels, TP = CP = PP = 1 .*; got parallel.tensor_model_parallel_size=2$"),
    ("", ["--precision.batch_invariant=true", "--rollout.decode_steps_per_sync=0"], 1, r"precision.batch_invariant needs .*; got rollout.decode_steps_per_sync=0$"),
    ("", ["--precision.batch_invariant=true", "--rollout.precision=bf16"], 1, r"precision.batch_invariant needs .*; got rollout.precision='bf16'$"),
    ("", ["--precision.batch_invariant=true", "--parallel.expert_model_parallel_size=2"], 2, r"precision.batch_invariant needs .*; got parallel.expert_model_parallel_size=2 with rollout.decode_experts='auto'$"),
    # YaRN: a factor below 1 would shrink the context
    ("", ["--model.position_embedding_type=yarn", "--model.yarn_rotary_scaling_factor=0.5"], 1, r"model.yarn_rotary_scaling_factor: must be >= 1 \(YaRN extends the context\), got 0.5"),
    # chat template arguments: a mapping, for an HF tokenizer's template
    ("", ["--tokenizer.chat_template_kwargs={enable_thinking: false}"], 1, r"tokenizer.chat_template_kwargs: applies to a Hugging Face chat template \(tokenizer.kind: hf\), got kind 'sentencepiece'"),
    ("", ["--tokenizer.chat_template_kwargs=5"], 1, r"tokenizer.chat_template_kwargs: expected a mapping such as \{key: value\} or null, got 5"),
    ("model: !!python/object/apply:os.system ['echo pwned']\n", [], 1, r"recipe.yaml:1"),
]


@pytest.mark.parametrize("text, overrides, world, message", CONFIG_CASES)
def test_bad_configs(tmp_path, text, overrides, world, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        cfg = load_config(_config(tmp_path, text), overrides)
        validate_config(cfg, world_size=world)


def test_library_defaults_need_only_a_model_long_enough():
    """The defaults are production's (1024-token prompts and responses): valid once the model
    fits them."""
    validate_config(load_config(None, ["--model.seq_length=2048"]), world_size=1)


DATA_CASES = [
    # (file name, content, kwargs, message regex)
    ("bad.jsonl", '{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n', {}, r"bad.jsonl:2"),
    ("missing.jsonl", '{"prompt": "1+1=", "answer": "2"}\n{"question": "2+2=", "answer": "4"}\n', {}, r"missing.jsonl:2.*prompt"),
    ("noanswer.jsonl", '{"prompt": "1+1="}\n', {}, r"noanswer.jsonl:1.*answer"),
    ("empty_prompt.jsonl", '{"prompt": "   ", "answer": "2"}\n', {}, r"empty_prompt.jsonl:1.*empty"),
    ("empty.jsonl", "", {}, r"empty.jsonl.*no examples|empty.jsonl.*zero|empty.jsonl"),
    ("verl.jsonl", '{"prompt": [{"role": "user", "content": "hi"}], "reward_model": {}}\n',
     {"answer_key": "reward_model.ground_truth"}, r"verl.jsonl:1.*reward_model.ground_truth"),
    ("notalist.jsonl", '[1, 2, 3]\n', {}, r"notalist.jsonl:1"),
]


@pytest.mark.parametrize("name, content, kwargs, message", DATA_CASES)
def test_bad_datasets(tmp_path, name, content, kwargs, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DatasetError, match=message):
        load_prompt_dataset(str(path), **kwargs)


def _raises(response, answer, example=None):
    raise RuntimeError("boom")


def _sleeps(response, answer, example=None):
    time.sleep(2.0)
    return 1.0


def _returns_text(response, answer, example=None):
    return "correct"


def _returns_nan(response, answer, example=None):
    return math.nan


@pytest.mark.parametrize("fn, counter", [(_raises, "reward/errors"), (_sleeps, "reward/timeouts"),
                                         (_returns_text, "reward/invalid"), (_returns_nan, "reward/invalid")])
def test_bad_reward_functions_score_zero_and_are_counted(fn, counter):
    rewards, stats = compute_rewards(fn, ["a", "b"], ["1", "2"], None, timeout_s=0.2)
    assert torch.equal(rewards, torch.zeros(2))
    assert stats[counter] == 2


def test_unknown_reward_lists_the_registered_ones():
    with pytest.raises(ValueError, match="arithmetic_exact"):
        get_reward_fn("no_such_reward")
    with pytest.raises((ValueError, ImportError), match="no_such_module"):
        get_reward_fn("no_such_module.sub:fn")


@pytest.mark.parametrize("field, value", [("clip_low", "2"), ("clip_high", "-1")])
def test_clip_errors_name_the_field_and_the_value_once(tmp_path, field, value):
    """From a recipe or an override, the line is ``where: loss.field: problem, got value``: the
    field and the value each appear once after the source."""
    for path, overrides in ((_config(tmp_path, f"loss:\n  {field}: {value}\n"), []),
                            (DEMO_RECIPE, [f"--loss.{field}={value}"])):
        with pytest.raises(ConfigError) as info:
            load_config(path, overrides)
        (line,) = info.value.errors
        problem = line.split(f"loss.{field}: ", 1)[1]
        assert problem.count(f"got {float(value)}") == 1 and str(float(value)) not in \
            problem.replace(f"got {float(value)}", ""), line


def test_verbose_is_a_flag_not_an_override():
    from gspo_megatron.config.loader import parse_cli, parse_command_line

    args = parse_command_line(["--verbose", "--trainer.steps", "3", "-c", "r.yaml"])
    assert args[:3] == ("r.yaml", ["--trainer.steps=3"], True) and not args.check
    assert parse_command_line(["--trainer.steps=3"]).verbose is False
    assert parse_cli(["--verbose", "--trainer.steps=3"]) == (None, ["--trainer.steps=3"])


@pytest.mark.parametrize("args, message", [
    (["--rollout.group_szie=4"], "rollout.group_szie: unknown field; did you mean 'group_size'"),
    (["--data.source=file", "--data.train_path=/nonexistent.jsonl"], "/nonexistent.jsonl"),
    (["--data.max_prompt_length=3"], "more than data.max_prompt_length=3"),
    (["--trainer.max_tokens_per_microbatch=8"], "trainer.max_tokens_per_microbatch=8 cannot hold "
                                                "the longest sequence the recipe allows"),
    (["--loss.clip_low=2"], "override '--loss.clip_low=2': loss.clip_low: must be < 1 (lower "
                            "bound 1 - clip_low > 0), got 2.0"),
    (["--loss.clip_high=-1"], "override '--loss.clip_high=-1': loss.clip_high: must be >= 0, "
                              "got -1.0"),
    (["--verbose", "--loss.clip_high=-1"], "loss.clip_high: must be >= 0, got -1.0"),
    # a value that failed to parse is not judged again by the checks that depend on it (no
    # "optim.min_lr must be <= optim.lr" against the default lr)
    (["--config", TINY_RECIPE, "--optim.lr=.inf"],
     "override '--optim.lr=.inf': optim.lr: expected a finite float, got inf"),
])
def test_cli_user_errors_exit_2_with_one_line_and_write_nothing(tmp_path, args, message):
    """Without --verbose, stderr is exactly the one error line (no start-up warnings)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=root, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "gspo_megatron.cli", f"--logging.run_dir={run_dir}",
                           "--data.num_train_examples=50", "--data.num_eval_examples=10", *args],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("gspo-train: error:"), proc.stderr
    assert not run_dir.exists()  # nothing written before the input was accepted


def test_a_non_utf8_recipe_names_the_file_and_line(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_bytes(b"trainer:\n  steps: 2\n# caf\xe9\nrollout:\n  group_size: 4\n")
    with pytest.raises(ConfigError) as ei:
        load_config(str(path))
    assert str(ei.value) == (f"{path}:3: not UTF-8 text (byte 0xe9 at offset 25); save the "
                             "recipe as UTF-8")


def test_an_unparsed_value_only_reports_itself():
    """``--optim.lr=.inf`` on a recipe whose min_lr is 3e-5: one error (the lr), not a second
    one comparing min_lr with the default lr the failed field fell back to."""
    with pytest.raises(ConfigError) as ei:
        load_config(TINY_RECIPE, ["--optim.lr=.inf"])
    assert ei.value.errors == ["override '--optim.lr=.inf': optim.lr: expected a finite float, "
                               "got inf"]


@pytest.mark.parametrize("overrides, error", [
    (["--loss.variant=GRPO_", "--loss.aggregation=token_mean"],
     "override '--loss.variant=GRPO_': loss.variant: expected one of "
     f"{', '.join(map(repr, LOSSES))}, got 'GRPO_'; did you mean 'grpo'?"),
    (["--data.source=fiel", "--data.num_train_examples=0"],  # checked for built-in tasks only
     "override '--data.source=fiel': data.source: expected one of 'arithmetic', 'arithmetic_chain', "
     "'file', got 'fiel'; did you mean 'file'?"),
    (["--rollout_correction.mode=mask", "--rollout_correction.band_low=3",
      "--rollout_correction.cap=.inf"],  # the band's upper edge comes from cap
     "override '--rollout_correction.cap=.inf': rollout_correction.cap: expected a finite float, "
     "got inf"),
], ids=["loss.variant", "data.source", "rollout_correction.cap"])
def test_checks_that_depend_on_an_unparsed_value_stay_silent(overrides, error):
    """Every problem names each field it depends on (data's built-in-task knobs name source, the
    correction band names cap and mode), so the one value that failed to parse is the only
    error."""
    with pytest.raises(ConfigError) as ei:
        load_config(None, overrides)
    assert ei.value.errors == [error]


def test_an_unparsed_value_leaves_the_sections_other_checks():
    with pytest.raises(ConfigError) as ei:
        load_config(TINY_RECIPE, ["--optim.lr=.inf", "--optim.adam_beta1=2"])
    assert len(ei.value.errors) == 2 and "optim.lr" in ei.value.errors[0]
    assert "optim.adam_beta1" in ei.value.errors[1]
