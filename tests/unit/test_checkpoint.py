"""Checkpoints: exact round trip, atomic layout, fallback past a damaged checkpoint, clear errors."""

import os

import pytest
import torch

from gspo_megatron.algorithms import PolicyLossConfig
from gspo_megatron.config.model import ParallelConfig, PrecisionConfig, model_config_from_preset
from gspo_megatron.backends.megatron import checkpoint as ckpt
from gspo_megatron.backends.megatron.checkpoint_writer import AsyncCheckpointWriter
from gspo_megatron.policy import make_policy_batch
from gspo_megatron.config import OptimConfig
from gspo_megatron.backends.megatron.policy import build_policy
from gspo_megatron.backends.megatron.schedule import ScoringConfig, compute_logprobs
from tests.helpers.megatron import train_minibatch

pytestmark = pytest.mark.slow  # builds Megatron models (make test-fast skips it)


@pytest.fixture(scope="module")
def groups():
    from gspo_megatron.backends.megatron.parallel import destroy_distributed, initialize_distributed

    g = initialize_distributed(ParallelConfig(), model_config_from_preset("tiny"), seed=3)
    yield g
    destroy_distributed()


def make_policy(groups, **model_overrides):
    model = model_config_from_preset("tiny", **model_overrides)
    return build_policy(model, ParallelConfig(), PrecisionConfig(), OptimConfig(lr=1e-3), groups,
                        total_steps=10)


def train_steps(policy, groups, n):
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 100, (12,), generator=gen).tolist() for _ in range(8)]
    batch = make_policy_batch(seqs, [3] * 8, pad_id=0)
    batch.advantages = torch.randn(8, generator=gen)
    scoring = ScoringConfig(vocab_size=100)
    batch.old_logprobs, _ = compute_logprobs(policy.model, batch, 4, scoring, groups)
    losses = []
    for _ in range(n):
        policy.zero_grad()
        losses.append(train_minibatch(policy.model, batch, 4, PolicyLossConfig(variant="grpo"),
                                      scoring, groups)["loss/policy"])
        policy.optimizer_step()
    return losses


def test_resume_is_exact_and_layout_is_megatrons(groups, tmp_path):
    policy = make_policy(groups)
    train_steps(policy, groups, 1)
    ckpt.save_checkpoint(policy, str(tmp_path), ckpt.TrainingState(1, {"sampler": {"epoch": 0, "position": 5}}))
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert (tmp_path / "iter_0000001" / "metadata.json").is_file()
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    expected = train_steps(policy, groups, 2)

    state = ckpt.load_checkpoint(policy, str(tmp_path))
    assert state.step == 1 and state.extra == {"sampler": {"epoch": 0, "position": 5}}
    assert train_steps(policy, groups, 2) == expected  # bitwise: weights, Adam, schedule
    # (the RNG states: tests/unit/test_resume_rng.py; nothing here draws from them)


def test_background_save_holds_the_state_at_save_time(groups, tmp_path):
    """checkpoint.async_save: the forked writer writes the weights as they were when save() was
    called while training goes on; nothing is the latest until wait() commits it, and resuming
    from it continues exactly as the run did from that point."""
    policy = make_policy(groups)
    train_steps(policy, groups, 1)
    writer = AsyncCheckpointWriter()
    ckpt.save_checkpoint(policy, str(tmp_path), ckpt.TrainingState(1, {"k": 1}), writer=writer)
    assert writer.pending
    assert ckpt.read_latest(str(tmp_path)) is None and ckpt.list_checkpoints(str(tmp_path)) == []
    expected = train_steps(policy, groups, 2)  # weights and Adam state change meanwhile
    assert writer.wait() >= 0 and not writer.pending and writer.wait() == 0.0
    assert ckpt.read_latest(str(tmp_path)) == 1 and ckpt.list_checkpoints(str(tmp_path)) == [1]
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    state = ckpt.load_checkpoint(policy, str(tmp_path))
    assert state.step == 1 and state.extra == {"k": 1}
    assert train_steps(policy, groups, 2) == expected


def test_an_aborted_background_save_never_becomes_the_latest(groups, tmp_path):
    policy = make_policy(groups)
    train_steps(policy, groups, 1)
    ckpt.save_checkpoint(policy, str(tmp_path), ckpt.TrainingState(1, {}))
    writer = AsyncCheckpointWriter()
    ckpt.save_checkpoint(policy, str(tmp_path), ckpt.TrainingState(2, {}), writer=writer)
    writer.abort()
    assert not writer.pending
    assert ckpt.read_latest(str(tmp_path)) == 1 and ckpt.list_checkpoints(str(tmp_path)) == [1]
    # A later save of the same step replaces the abandoned .tmp directory.
    ckpt.save_checkpoint(policy, str(tmp_path), ckpt.TrainingState(2, {}), writer=writer)
    writer.wait()
    assert ckpt.read_latest(str(tmp_path)) == 2 and ckpt.list_checkpoints(str(tmp_path)) == [1, 2]


def test_keep_last_rotates(groups, tmp_path):
    policy = make_policy(groups)
    for step in (1, 2, 3):
        ckpt.save_checkpoint(policy, str(tmp_path), ckpt.TrainingState(step, {}), keep_last=2)
    assert ckpt.list_checkpoints(str(tmp_path)) == [2, 3]


def test_damaged_latest_falls_back_to_previous(groups, tmp_path):
    policy = make_policy(groups)
    ckpt.save_checkpoint(policy, str(tmp_path), ckpt.TrainingState(1, {}))
    ckpt.save_checkpoint(policy, str(tmp_path), ckpt.TrainingState(2, {}))
    shard = next(p for p in (tmp_path / "iter_0000002").iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:100])  # truncated file
    assert ckpt.load_checkpoint(policy, str(tmp_path)).step == 1


def test_wrong_model_shape_is_a_clear_error(groups, tmp_path):
    ckpt.save_checkpoint(make_policy(groups), str(tmp_path), ckpt.TrainingState(1, {}))
    wider = make_policy(groups, hidden_size=128, moe_ffn_hidden_size=128, ffn_hidden_size=256)
    with pytest.raises(ckpt.CheckpointError, match=r"iter_0000001: .*[Ss]hape mismatch"):
        ckpt.load_checkpoint(wider, str(tmp_path))


def test_missing_and_bad_pointer(tmp_path, groups):
    policy = make_policy(groups)
    with pytest.raises(ckpt.CheckpointError, match="nothing to resume"):
        ckpt.load_checkpoint(policy, str(tmp_path))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("garbage")
    with pytest.raises(ckpt.CheckpointError, match="expected an iteration number"):
        ckpt.load_checkpoint(policy, str(tmp_path))


# ------------------------------------------------------------------ the per-rank state file

def _in_flight():
    """A rank state of the kinds a run keeps: a separate placement's received step (a
    StepSamples of RolloutSamples and PromptExamples), partial groups, an engine's held state."""
    from gspo_megatron.data.prompts import PromptExample
    from gspo_megatron.policy import RolloutSample
    from gspo_megatron.stages import StepSamples

    samples = StepSamples(
        prompts=[PromptExample("1+2=", "3", index=4, uid="4", metadata={"src": "t"})],
        samples=[RolloutSample([1, 2], [3, 0], [-0.5, -0.25], "eos", extra={"routes": None})],
        advantages=torch.randn(1, dtype=torch.float32), metrics={"reward/mean": 0.5},
        generated_tokens=2)
    return {"placement": "separate", "received": {3: {"step": 3, "samples": samples,
                                                      "skip": ("faults/x", {"a": 1.0})}},
            "sampler": {"epoch": 0, "position": 8}, "partial": None,
            "engine": {"held": [0, 2], "ids": {5, 7}, "kv": torch.ones(2, 3),
                       "dtype": torch.bfloat16, "np": __import__("numpy").arange(3)}}


def test_rank_state_round_trips_as_plain_data(tmp_path):
    """Written as plain data, read back with weights_only=True equal to what was saved."""
    from gspo_megatron.backends.megatron import plain_state

    state = _in_flight()
    path = tmp_path / "rank" / "rank_00000.pt"
    path.parent.mkdir()
    torch.save({"format": plain_state.FORMAT, "state": plain_state.encode(state)}, path)
    torch.load(path, weights_only=True)  # no pickled object in it
    back = ckpt.read_rank_state(str(tmp_path), 0)
    got, want = back["received"][3]["samples"], state["received"][3]["samples"]
    assert type(got) is type(want) and got.prompts == want.prompts and got.samples == want.samples
    assert torch.equal(got.advantages, want.advantages) and got.metrics == want.metrics
    assert back["received"][3]["skip"] == ("faults/x", {"a": 1.0})
    engine = back["engine"]
    assert engine["ids"] == {5, 7} and engine["dtype"] is torch.bfloat16
    assert torch.equal(engine["kv"], torch.ones(2, 3)) and list(engine["np"]) == [0, 1, 2]
    with pytest.raises(TypeError, match="not in plain_state.RECORD_TYPES"):
        plain_state.encode({"x": ckpt.TrainingState(step=1, extra={})})
    with pytest.raises(ValueError, match="unknown record type 'os:system'"):
        plain_state.decode({plain_state.TYPE_KEY: "os:system", "fields": {}})


def test_a_pickled_rank_state_needs_allow_pickle(tmp_path):
    """A rank state only a full unpickle reads (as written before the plain format) is refused
    without checkpoint.allow_pickle, read with it; plain data of before the format is read."""
    path = tmp_path / "rank" / "rank_00000.pt"
    path.parent.mkdir()
    state = _in_flight()
    torch.save(state, path)  # the old way: objects pickled
    with pytest.raises(ckpt.UnsafeCheckpointError, match="checkpoint.allow_pickle: true"):
        ckpt.read_rank_state(str(tmp_path), 0)
    assert ckpt.read_rank_state(str(tmp_path), 0, allow_pickle=True)["received"][3][
        "samples"].samples == state["received"][3]["samples"].samples
    torch.save({"placement": "colocated", "partial": None}, path)  # old, but plain data
    assert ckpt.read_rank_state(str(tmp_path), 0) == {"placement": "colocated", "partial": None}


# A fresh interpreter (megatron's results queue is per process): the trainer's SIGTERM handler
# installed, the results server started, a torch_dist save and load; then what ran as children.
_RESULTS_SERVER_SCRIPT = r"""
import json, os, signal, sys
import psutil
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem_async
from gspo_megatron.backends.megatron.checkpoint_writer import start_write_results_server
from gspo_megatron.compat import apply_compat

def children():
    return {c.pid: c.cmdline() for c in psutil.Process().children()}

apply_compat()  # megatron-core on CPU (as every entry point does)
signal.signal(signal.SIGTERM, lambda *a: None)  # as the trainer's checkpoint-and-exit handler
if sys.argv[1] == "fork":
    start_write_results_server()
    start_write_results_server()  # a second call keeps the first server
server = children()
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[3], rank=0, world_size=1)
x = torch.arange(6.0)
os.makedirs(sys.argv[2])
dist_checkpointing.save({"x": ShardedTensor.from_rank_offsets("x", x)}, sys.argv[2])
back = dist_checkpointing.load({"x": ShardedTensor.from_rank_offsets("x", torch.empty(6))},
                              sys.argv[2])
caught = {}
for pid in children():
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("SigCgt:"):
            caught[pid] = bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
mine = psutil.Process().cmdline()
print(json.dumps({"equal": torch.equal(back["x"], x), "server": sorted(server),
                  "children": sorted(children()), "caught_sigterm": caught,
                  "spawned": sum(c != mine for c in children().values())}), flush=True)
if sys.argv[1] == "fork":  # killed, as a rank by the OOM killer (megatron's spawned server
    os.kill(os.getpid(), signal.SIGKILL)  # would outlive it, holding this process's pipes)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("start", ["fork", "megatron"])
def test_the_write_results_server_is_forked_before_the_first_save(tmp_path, start):
    """``start_write_results_server``: megatron-core's results queue served by one forked child
    (the interpreter's own command line, SIGTERM not caught), ready before the first save, which
    then starts no interpreter; killed with SIGKILL, the process leaves no server behind.
    Without it ("megatron"), the first save spawns one: the cost the function removes (a fresh
    interpreter re-importing the launching script)."""
    import contextlib
    import json
    import signal
    import subprocess
    import sys

    import psutil

    from gspo_megatron.backends.megatron.parallel import _free_port

    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as o, open(err, "w") as e:  # files: a leftover child holds no pipe
        rc = subprocess.run([sys.executable, "-c", _RESULTS_SERVER_SCRIPT, start,
                             str(tmp_path / "ckpt"), str(_free_port())], stdout=o, stderr=e,
                            timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1")).returncode
    assert rc == (-signal.SIGKILL if start == "fork" else 0), err.read_text()[-3000:]
    got = json.loads(out.read_text().strip().splitlines()[-1])
    assert got["equal"]
    if start == "fork":
        assert len(got["server"]) == 1 and got["children"] == got["server"], got
        assert got["spawned"] == 0 and list(got["caught_sigterm"].values()) == [False], got
        # The server ends with its killed parent.
        with contextlib.suppress(psutil.NoSuchProcess):
            server = psutil.Process(got["server"][0])
            with contextlib.suppress(psutil.TimeoutExpired):
                server.wait(30)
            alive = server.is_running() and server.status() != psutil.STATUS_ZOMBIE
            if alive:
                server.kill()
            assert not alive, "the results server outlived its killed parent"
    else:
        assert got["server"] == [] and got["spawned"] >= 1, got  # (and a resource tracker)
