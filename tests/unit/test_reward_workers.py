"""The reward worker pool (gspo_megatron/rewards/workers.py): results identical to the in-process
path, a hung call stopped at its timeout (its worker killed and replaced, the batch goes on), a
worker that dies mid-call scored as an error, calls spread over the workers, and cheap rewards
kept inline. Real processes (spawn), a reward module written to a temporary directory."""

import math
import os
import textwrap
import time
from pathlib import Path

import pytest
import torch

from gspo_megatron.rewards import compute_rewards, get_reward_fn
from gspo_megatron.rewards.math import math_exact
from gspo_megatron.rewards.registry import is_cheap
from gspo_megatron.rewards.workers import RewardWorkers, start_reward_workers

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 3.0

MODULE = textwrap.dedent('''
    import math, os, time
    import torch

    def score(response, answer, example=None):
        """A deterministic float from the texts; special responses misbehave."""
        if response == "raise":
            raise KeyError("no such key")
        if response == "text":
            return "not a number"
        if response == "nan":
            return math.nan
        if response == "tensor":
            return torch.tensor([0.25])
        if response == "hang":
            while True:
                time.sleep(0.05)
        if response == "die":
            os._exit(3)
        return (sum(map(ord, response)) % 97) / 97 + len(answer) * 1e-3

    def pid(response, answer, example=None):
        time.sleep(0.05)
        return float(os.getpid())
''')


@pytest.fixture
def reward_dir(tmp_path):
    (tmp_path / "pool_rewards.py").write_text(MODULE)
    return str(tmp_path)


def _inline(fn, responses, answers):
    """The reference: every call in this thread (no timeout), as compute_rewards(timeout_s=None)."""
    return compute_rewards(fn, responses, answers, timeout_s=None)


def test_results_match_the_in_process_path_exactly(reward_dir):
    responses = [f"resp {i}" for i in range(40)] + ["raise", "text", "nan", "tensor"]
    answers = [str(i) for i in range(len(responses))]
    fn = get_reward_fn("pool_rewards:score", [reward_dir])
    want, want_stats = _inline(fn, responses, answers)
    with RewardWorkers("pool_rewards:score", 2, timeout_s=20, search_dirs=[reward_dir]) as pool:
        got, stats = compute_rewards(fn, responses, answers, timeout_s=20, workers=pool)
    assert torch.equal(got, want)
    assert stats == want_stats
    assert (stats["reward/errors"], stats["reward/invalid"]) == (1.0, 2.0)
    assert got[-1].item() == 0.25  # a one-element tensor is a reward


def test_a_hung_call_is_stopped_and_the_batch_goes_on(reward_dir):
    fn = get_reward_fn("pool_rewards:score", [reward_dir])
    responses = ["a", "hang", "b", "c", "hang", "d"]
    # TIMEOUT_S is far above a normal call (~1 ms) so that a loaded machine cannot turn one
    # into a timeout; each hang costs it once (the two hang in parallel).
    with RewardWorkers("pool_rewards:score", 2, timeout_s=TIMEOUT_S, search_dirs=[reward_dir]) as pool:
        before = {w.process.pid for w in pool._workers}
        start = time.monotonic()
        got, stats = compute_rewards(fn, responses, ["x"] * 6, timeout_s=TIMEOUT_S, workers=pool)
        took = time.monotonic() - start
        after = {w.process.pid for w in pool._workers}
        # the hung calls were stopped: their workers are dead, replaced by new ones
        assert pool.killed == 2 and len(after - before) == 2 and len(pool._workers) == 2
        assert stats["reward/timeouts"] == 2.0 and stats["reward/hung_threads"] == 0.0
        want, _ = _inline(fn, ["a", "b", "c", "d"], ["x"] * 4)
        assert got[[0, 2, 3, 5]].tolist() == want.tolist() and got[[1, 4]].tolist() == [0.0, 0.0]
        assert took < 20  # each hang costs its timeout, not forever
        again, stats = compute_rewards(fn, ["a", "b"], ["x", "x"], timeout_s=TIMEOUT_S, workers=pool)
        assert again.tolist() == want[:2].tolist() and stats["reward/timeouts"] == 0.0


def test_a_worker_that_dies_scores_an_error_and_is_replaced(reward_dir):
    fn = get_reward_fn("pool_rewards:score", [reward_dir])
    with RewardWorkers("pool_rewards:score", 1, timeout_s=20, search_dirs=[reward_dir]) as pool:
        got, stats = compute_rewards(fn, ["a", "die", "b"], ["x"] * 3, timeout_s=20, workers=pool)
        assert stats["reward/errors"] == 1.0 and got[1].item() == 0.0
        assert got[2].item() == _inline(fn, ["b"], ["x"])[0].item()


def test_calls_are_spread_over_the_workers(reward_dir):
    fn = get_reward_fn("pool_rewards:pid", [reward_dir])
    with RewardWorkers("pool_rewards:pid", 2, timeout_s=20, search_dirs=[reward_dir]) as pool:
        got, _ = compute_rewards(fn, ["r"] * 8, ["x"] * 8, timeout_s=20, workers=pool)
        pids = {w.process.pid for w in pool._workers}
    assert set(int(v) for v in got.tolist()) == pids and len(pids) == 2
    assert os.getpid() not in pids


def test_where_rewards_run(reward_dir, caplog):
    builtin = get_reward_fn("arithmetic_exact")
    fn = get_reward_fn("pool_rewards:score", [reward_dir])
    assert is_cheap(builtin) and is_cheap(math_exact) and not is_cheap(fn)
    assert start_reward_workers("arithmetic_exact", builtin, 2, 5.0) is None  # inline
    assert start_reward_workers("pool_rewards:score", fn, 0, 5.0, [reward_dir]) is None
    # a reward the workers cannot load (not on their path): one warning, then threads
    with caplog.at_level("WARNING"):
        assert start_reward_workers("pool_rewards:score", fn, 1, 5.0, []) is None
    assert "cannot load 'pool_rewards:score'" in caplog.text and "threads" in caplog.text


def test_math_exact_refuses_huge_exponents_quickly():
    """A model output like '1e999999999' once made Fraction() build a billion-digit integer."""
    start = time.monotonic()
    assert math_exact("#### 1e999999999", "5") == 0.0
    assert math_exact("#### 1e-99999", "0") == 0.0
    assert time.monotonic() - start < 1.0
    assert math_exact("#### 1e3", "1000") == 1.0 and math_exact("#### 2.5e-2", "1/40") == 1.0
    assert not math.isnan(math_exact("#### 1e400", "1e400"))


def test_math_verify_warms_up_each_worker_on_its_verify_path():
    """Each new worker calls math_verify once before taking real calls (imports and parser
    set-up: seconds, which must not count against the first call's timeout); the warm-up pair
    is one math-verify proves equal, so the call goes through parse *and* verify."""
    pytest.importorskip("math_verify")
    from gspo_megatron.rewards.registry import warmup_call

    pair = warmup_call(get_reward_fn("math_verify"))
    assert pair is not None and get_reward_fn("math_verify")(*pair) == 1.0
    assert pair[0].replace(" ", "") != "\\boxed{" + pair[1].replace(" ", "") + "}"  # not textual
    with RewardWorkers("math_verify", 1, timeout_s=30) as pool:
        got, stats = compute_rewards(get_reward_fn("math_verify"), [r"\boxed{\frac{1}{2}}", "#### 7"],
                                     ["0.5", "8"], timeout_s=30, workers=pool)
    assert got.tolist() == [1.0, 0.0] and stats["reward/timeouts"] == 0.0


ORPHAN_SCRIPT = textwrap.dedent('''
    import sys
    from gspo_megatron.rewards.workers import RewardWorkers

    if __name__ == "__main__":  # spawn re-imports the main module in each worker
        pool = RewardWorkers("pool_rewards:score", 2, timeout_s=600, search_dirs=[sys.argv[1]]).start()
        with open(sys.argv[2], "w") as f:
            f.write(" ".join(str(w.process.pid) for w in pool._workers))
        pool.run([("hang", "x", None), ("hang", "y", None)])  # never returns: the test kills us
''')


def test_workers_die_with_a_killed_trainer_even_mid_call(reward_dir, tmp_path):
    """SIGKILL the process that owns the pool while both workers are stuck in a call: the kernel
    kills them too (PR_SET_PDEATHSIG), so no orphaned reward process keeps a core busy."""
    import signal
    import subprocess
    import sys

    script, pids_file = tmp_path / "owner.py", tmp_path / "pids"
    script.write_text(ORPHAN_SCRIPT)
    owner = subprocess.Popen([sys.executable, str(script), reward_dir, str(pids_file)],
                             env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        deadline = time.monotonic() + 120
        while not (pids_file.exists() and pids_file.read_text().strip()):
            assert owner.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        pids = [int(p) for p in pids_file.read_text().split()]
        time.sleep(0.5)  # both calls are now running in the workers
        assert all(_running(p) for p in pids)
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 10
        while any(_running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_running(p) for p in pids)
    finally:
        if owner.poll() is None:
            owner.kill()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
