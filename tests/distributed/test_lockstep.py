"""Expert-parallel lock-step at DP > EP: the ranks whose steps are coupled decide together.

4 ranks, DP = 2 x EP = 2 (two EP groups). Group 0 is forced to replicate its experts for
decoding (its ranks then step alone), group 1 to keep them sharded (its ranks step in lock-step).
The lock-step agreement runs over the same group as the replication decision, so neither group
waits on a collective the other never joins (before, the agreement ran over the world: group 1
waited for group 0 forever). Each rank's greedy tokens equal its all-replicated run's.
"""

import json
import os

import pytest

from tests.helpers.torchrun import torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = os.path.join(os.path.dirname(__file__), "lockstep_worker.py")


def test_ep_groups_deciding_differently_do_not_deadlock(tmp_path):
    torchrun(4, WORKER, "--out", str(tmp_path), timeout=180)
    for rank in range(4):
        with open(tmp_path / f"rank{rank}.json") as f:
            got = json.load(f)
        assert got["reference_replicated"] is True, rank
        assert got["mixed_replicated"] is (rank < 2), rank
        assert len(got["mixed"]) == 2 + 3 * got["dp_rank"]
        for mine, ref in zip(got["mixed"], got["reference"]):
            assert mine["r"] == ref["r"] and mine["f"] == ref["f"], (rank, mine, ref)
            assert mine["lp"] == pytest.approx(ref["lp"], abs=1e-5), rank
    finish = [s["f"] for rank in range(4)
              for s in json.load(open(tmp_path / f"rank{rank}.json"))["mixed"]]
    assert "eos" in finish and "length" in finish, finish
