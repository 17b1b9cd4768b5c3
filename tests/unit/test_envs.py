"""Environments (:mod:`gspo_megatron.envs`): the tool-call parser, the checks on an environment's
answers, the built-in tools, the turn driver's rules against a scripted policy (every bad
environment a counted outcome, the run going on), and the worker pool's timeouts."""

from __future__ import annotations

import json

import pytest
import torch

from gspo_megatron.envs.base import ToolCallError, check_answer, parse_tool_calls
from gspo_megatron.envs.tools import calculator, run_python
from gspo_megatron.envs.turns import EPISODE_KEY, POLICY_MASK_KEY, Episodes, episode_rewards
from gspo_megatron.policy import RolloutSample
from gspo_megatron.envs.workers import EnvWorkers, InProcessEnvs, resolve_env_class
from gspo_megatron.tokenizer import Tokenizer
from tests.helpers.envs import BadEnv, Example


class CharTokenizer:
    """One id per character (``ord``); EOS 0. The chat format of tokenizers without a template."""

    eos_id = pad_id = 0
    continuation = Tokenizer.continuation

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i)

    def encode_prompt(self, prompt):
        return self.encode(prompt if isinstance(prompt, str) else prompt[-1]["content"])


def run_scripted(eps: Episodes, modes, texts, budget=400):
    """The engine's side of the turn loop, with a scripted policy: request ``i`` writes
    ``texts[i]`` then its EOS every turn. Returns (responses, driver)."""
    prompts, driver = eps.start([Example(m) for m in modes], budget)
    active = list(range(len(modes)))
    while active:
        sampled, at_limit = [], []
        for row in active:
            ep = driver.episodes[row]
            i = len(ep.tokens) - ep.turn_start
            sampled.append(ord(texts[row][i]) if i < len(texts[row]) else 0)
            at_limit.append(len(prompts[row]) + len(ep.tokens) + 1 >= len(prompts[row]) + budget)
        tokens, ended, forced = driver.step(active, torch.tensor(sampled), torch.tensor(at_limit))
        assert bool((tokens[~forced] == torch.tensor(sampled)[~forced]).all())
        active = [row for row, e in zip(active, ended.tolist()) if not e]
    return [driver.episodes[r].tokens for r in range(len(modes))], driver


def metrics(driver, responses):
    """The step's ``env/*`` of the episodes (their samples, as the engine returns them)."""
    samples = [RolloutSample([1], tokens, [0.0] * len(tokens), driver.finish_reason(row),
                             driver.extra(row, tokens)) for row, tokens in enumerate(responses)]
    return episode_rewards(samples)


def test_parse_tool_calls():
    good = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
    assert parse_tool_calls("let me " + good + " and " + good) == [
        {"name": "calculator", "arguments": {"expression": "2+3"}}] * 2
    assert parse_tool_calls("no call") == []
    for bad in ('<tool_call>{"name": "c", </tool_call>', '<tool_call>[1]</tool_call>',
                '<tool_call>{"name": "c", "arguments": 3}</tool_call>', '<tool_call>{"name": "c"}'):
        with pytest.raises(ToolCallError):
            parse_tool_calls(bad)


def test_check_answer_rules():
    def step(*value):  # a step's return value, as the workers hand it over
        return check_answer((value if len(value) > 1 else value[0], None, False), 10)

    ok = step([{"role": "tool", "content": "x" * 50}], None, False)
    assert ok.problem is None and ok.messages[0]["content"] == "x" * 10 and ok.truncated == 1
    assert step([], 1.5, True)[:4] == ([], 1.5, True, None)
    assert check_answer((None, "ValueError: boom", False), 10).kind == "errors"
    assert check_answer((None, None, True), 10).kind == "timeouts"
    for value in (([{"role": "tool", "content": b"\xff"}], None, False),
                  ([{"role": "tool", "content": "\udc80"}], None, False),
                  ([{"content": "no role"}], None, False), ([], float("inf"), True),
                  ([], "high", True), ("nope",)):
        assert step(*value).kind == "bad_answers", value
    assert step([{"role": "tool", "content": b"caf\xc3\xa9"}], None,
                False).messages[0]["content"] == "café"
    assert check_answer(([{"role": "user", "content": "q"}], None, False), 10, first=True).messages


def test_calculator():
    assert calculator("12*(3+4) - 5") == "79"
    assert calculator("7/2") == "3.5" and calculator("2**10") == "1024"
    for bad in ("__import__('os')", "1/0", "2**1000", "x+1", "9" * 600):
        assert calculator(bad).startswith("error:"), bad


def test_python_sandbox_limits():
    assert run_python("print(sum(range(10)))") == "45\n"
    assert "PermissionError" in run_python("import socket; socket.socket().connect(('1.1.1.1', 80))")
    assert "PermissionError" in run_python("import subprocess; subprocess.run(['ls'])")
    assert run_python("import time; time.sleep(30)", timeout_s=1.0) == "error: timed out after 1 s"
    assert "killed by signal" in run_python("while True: pass", timeout_s=20, cpu_s=1)
    assert "MemoryError" in run_python("x = bytearray(4 << 30)", memory_mb=256)
    out = run_python("print('a' * 10000)", max_output_chars=100)
    assert out == "a" * 100 + "... [truncated]"


def test_bad_environments_are_counted_outcomes_and_the_rollout_goes_on():
    modes = ["raise", "huge", "bytes", "surrogate", "badreward", "never", "resetfail", "good", "good"]
    call = '<tool_call>' + json.dumps({"name": "calculator", "arguments": {"expression": "1"}}) + '</tool_call>'
    texts = ["ab"] * 7 + [call, "<tool_call>{bad</tool_call>"]
    eps = Episodes(InProcessEnvs(BadEnv), CharTokenizer(), max_turns=3, max_turn_tokens=100,
                   max_message_chars=100)
    responses, driver = run_scripted(eps, modes, texts)
    ends = [ep.end for ep in driver.episodes]
    assert ends == ["errors", "done", "bad_answers", "bad_answers", "bad_answers",
                    "max_turns_cut", "reset_errors", "done", "done"]
    rewards, m = metrics(driver, responses)
    assert (m["env/errors"], m["env/bad_answers"], m["env/truncated_messages"],
            m["env/max_turns_cut"], m["env/reset_failures"], m["env/invalid_tool_calls"]) == \
        (2, 3, 2, 1, 1, 2)  # (huge: cut at both of its answers)
    assert rewards.tolist() == [0.0] * 7 + [1.0, 1.0] and m["reward/accuracy"] == 2 / 9
    extras = [driver.extra(r, responses[r]) for r in range(len(modes))]
    rewards = [e[EPISODE_KEY]["reward"] for e in extras]
    assert rewards == [0.0] * 7 + [1.0, 1.0]
    assert [e[EPISODE_KEY]["tool_calls"] for e in extras][-2:] == [2, 0]
    # the huge answer was cut to 100 characters: its tokens are the chat format around them
    huge = extras[1][POLICY_MASK_KEY]
    env_tokens = len(huge) - sum(huge)
    assert env_tokens == len(CharTokenizer().continuation([{"role": "tool", "content": "7" * 100}]))
    # a reset that failed: one token, not the policy's
    assert responses[6] == [ord("a")] and extras[6][POLICY_MASK_KEY] == [0]
    # the never-ending episode: 3 policy turns (each "ab" + EOS), two environment answers
    never = extras[5][POLICY_MASK_KEY]
    assert sum(never) == 9 and driver.episodes[5].turns == 3


def test_budget_cuts():
    eps = Episodes(InProcessEnvs(BadEnv), CharTokenizer(), max_turns=10, max_turn_tokens=5,
                   max_message_chars=100)
    responses, driver = run_scripted(eps, ["never", "never"], ["ab", "abcdefgh"], budget=30)
    assert [ep.end for ep in driver.episodes] == ["budget_cut", "turn_budget_cut"]
    assert len(driver.episodes[0].tokens) <= 30 and len(driver.episodes[1].tokens) == 5
    _, m = metrics(driver, responses)
    assert m["env/budget_cut"] == 1 and m["env/turn_budget_cut"] == 1


def test_missing_environment_class_is_one_line():
    for spec, words in (("tests.helpers.envs:Nope", "has no attribute"),
                        ("no_such_pkg.mod:Env", "cannot import module"),
                        ("nothing", "neither a built-in"),
                        ("tests.helpers.envs:time", "not callable"),
                        ("tests.helpers.envs:time.sleep", "must be a class")):
        with pytest.raises(ValueError) as e:
            resolve_env_class(spec)
        assert words in str(e.value) and "multi_turn.env" in str(e.value) and "\n" not in str(e.value)


def test_worker_timeout_stops_the_call_and_loses_only_its_workers_episodes():
    """Two workers; episode ``k`` lives in worker ``k % 2``. Episode 1 hangs in ``step``: it
    times out, its worker is replaced, and episode 3 (same worker) is lost; 0 and 2 go on. An
    ``async`` environment runs as well."""
    with EnvWorkers("tests.helpers.envs:BadEnv", 2, timeout_s=2.0) as pool:
        modes = ["good", "sleep", "good", "good"]
        assert all(o[1:] == (None, False) for o in pool.run([("reset", k, Example(m))
                                                             for k, m in enumerate(modes)]))
        out = pool.run([("step", k, "x") for k in range(4)])
        assert out[0] == (([{"role": "tool", "content": "ok"}], None, False), None, False)
        assert out[1] == (None, None, True)
        assert out[2][1] is None and "environment lost" in out[3][1]
        assert pool.lost == 1
        assert pool.run([("step", 0, "x")])[0][1:] == (None, False)
    with EnvWorkers("tests.helpers.envs:AsyncEnv", 1, timeout_s=5.0) as pool:
        assert pool.run([("reset", 0, Example("q")), ("step", 0, "a")]) == [
            ([{"role": "user", "content": "q"}], None, False), (([], 2.0, True), None, False)]


def test_continuation_through_a_chat_template(tmp_path):
    """An environment's messages between the policy's EOS and the next assistant turn, as a
    Qwen3-layout template renders them (the EOS itself is the policy's, not repeated), and the
    prompt + turn + continuation equal to the template's whole conversation."""
    from gspo_megatron.tokenizer import HFTokenizer, SentencePieceTokenizer
    from tests.helpers.reward_model import QWEN3_LIKE_TEMPLATE, char_tokenizer

    char_tokenizer(QWEN3_LIKE_TEMPLATE, eos="<|im_end|>").save_pretrained(str(tmp_path))
    tok = HFTokenizer(tmp_path)
    tool = [{"role": "tool", "content": "42"}]
    cont = tok.continuation(tool)
    assert cont == ("\n<|im_start|>tool\n<tool_response>\n42\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\n")
    user = [{"role": "user", "content": "6*7="}]
    turn = "<tool_call>{}</tool_call>"
    whole = tok.hf_tokenizer.apply_chat_template(
        user + [{"role": "assistant", "content": turn}] + tool, tokenize=False,
        add_generation_prompt=True)
    assert tok.apply_chat_template(user) + turn + "<|im_end|>" + cont == whole
    # without a template: "role: content" lines after the EOS, then "assistant: "
    assert SentencePieceTokenizer.continuation(None, tool) == "\ntool: 42\nassistant: "


def test_config_checks_of_multi_turn_and_reward_mixes(tmp_path):
    from gspo_megatron.config import ConfigError, load_config, validate_config

    recipe = "examples/configs/tiny_tool_gspo.yaml"
    assert validate_config(load_config(recipe)) == 1
    for override, words in (("--rollout.partial_rollouts=true", "rollout.partial_rollouts=True"),
                            ("--rollout.engine=static", "rollout.engine='static'"),
                            ("--precision.batch_invariant=true", "precision.batch_invariant=True"),
                            ("--multi_turn.env=nothing", "neither a built-in"),
                            ("--reward.fns={arithmetic_exact: 1.0}", "reward.fns with multi_turn")):
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace("[", r"\[")):
            validate_config(load_config(recipe, [override]))
    cfg = load_config(None, ["--reward.fns={arithmetic_exact: 1.0, reward_model: 0.5}"])
    with pytest.raises(ConfigError, match="reward_model.path must be the directory"):
        validate_config(cfg)
    with pytest.raises(Exception, match="reward.fns: expected a mapping"):
        load_config(None, ["--reward.fns={arithmetic_exact: high}"])
    assert load_config(None, ["--reward.fns={arithmetic_exact: 1}"]).reward.fns == {
        "arithmetic_exact": 1.0}


def test_demonstrations_are_laid_out_as_rollouts_lay_out_episodes():
    """The warm-up's sample of a demonstrated episode: the tokens a rollout of the same turns
    would hold (prompt, turn, EOS, the tool's answer through the chat format, turn, EOS), the
    policy's turns as targets only; half of the problems (by hash) demonstrate the tool."""
    from gspo_megatron.envs.arithmetic import ToolArithmeticEnv

    examples = [Example(f"{a}+{a + 7}=") for a in range(100, 160)]
    for e in examples:
        e.answer = str(int(e.prompt[:3]) * 2 + 7)
    demos = [ToolArithmeticEnv.demonstration(e) for e in examples]
    with_tool = [d for d in demos if len(d) == 4]
    assert 0.35 < len(with_tool) / len(demos) < 0.65
    tok = CharTokenizer()
    eps = Episodes(InProcessEnvs(ToolArithmeticEnv), tok, max_turns=3, max_turn_tokens=100,
                   max_message_chars=100, env_cls=ToolArithmeticEnv)
    assert eps.demonstrates
    samples = eps.sft_samples(examples)
    for demo, s in zip(demos, samples):
        user, *rest = demo
        ids = tok.encode_prompt([user])
        want_ids, want_mask = list(ids), [0] * len(ids)
        for m in rest:
            part = (tok.encode(m["content"]) + [0] if m["role"] == "assistant"
                    else tok.encode(tok.continuation([m])))
            want_ids += part
            want_mask += [int(m["role"] == "assistant")] * len(part)
        assert (s.input_ids, s.loss_mask, s.prompt_len) == (want_ids, want_mask, len(ids))
    # a demonstrated tool call is one the environment answers with the right sum
    env = ToolArithmeticEnv()
    user, call, tool, answer = with_tool[0]
    env.reset(Example(user["content"], answer["content"]))
    assert env.step(call["content"]) == ([tool], None, False) and tool["content"] == answer["content"]
