"""The memory profile's replay of an allocator trace (``logging.memory_profile_steps``): the peak
of allocated bytes and what is live at it, by the code that allocated it. The trace is the
layout ``torch.cuda.memory._snapshot()["device_traces"]`` has; recording needs CUDA."""

from __future__ import annotations

import logging

import pytest

from gspo_megatron.memory_profile import MemoryProfile, allocation_site, peak_allocations


def frame(filename: str, line: int, name: str) -> dict:
    return {"filename": filename, "line": line, "name": name}


OPTIM = [frame("/x/torch/_tensor.py", 1, "sqrt"), frame("/venv/torch/optim/adam.py", 762,
                                                          "_multi_tensor_adam")]
BACKWARD = [frame("/x/torch/autograd/graph.py", 5, "_engine_run_backward"),
            frame("/w/gspo_megatron/backends/megatron/kernels/moe.py", 99, "backward")]


def test_the_peak_and_what_is_live_at_it_by_site():
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": BACKWARD},
        {"action": "alloc", "addr": 2, "size": 50, "frames": BACKWARD},
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 3, "size": 300, "frames": OPTIM},  # peak: 50 + 300
        {"action": "alloc", "addr": 4, "size": 7, "frames": []},
        {"action": "free_completed", "addr": 3, "size": 300},
        {"action": "alloc", "addr": 5, "size": 200, "frames": OPTIM},
    ]
    got = peak_allocations(trace)
    assert got["peak_bytes"] == 357 and got["peak_event"] == 5 and got["events"] == 8
    assert got["sites"] == [
        {"site": "torch/optim/adam.py:762 _multi_tensor_adam", "bytes": 300, "count": 1},
        {"site": "gspo_megatron/backends/megatron/kernels/moe.py:99 backward", "bytes": 50,
         "count": 1},
        {"site": "?", "bytes": 7, "count": 1}]
    assert peak_allocations(trace, top=1)["other_bytes"] == 57
    # A trace with requested frees only counts those (a free never completed keeps the block).
    requested = [dict(e, action="free_requested") if e["action"] == "free_completed" else e
                 for e in trace if e["action"] != "free_requested"]
    assert peak_allocations(requested)["peak_bytes"] == 357
    assert peak_allocations([])["peak_bytes"] == 0


def test_a_site_is_the_first_frame_of_ours_megatrons_or_the_optimizers():
    assert allocation_site([frame("/a/torch/nn/functional.py", 3, "linear"),
                            frame("/b/megatron/core/tensor_parallel/layers.py", 40, "forward"),
                            frame("/w/gspo_megatron/policy.py", 7, "run")]) == \
        "megatron/core/tensor_parallel/layers.py:40 forward"
    assert allocation_site([frame("/a/lib/x.py", 3, "f")]) == "/a/lib/x.py:3 f"
    assert allocation_site([]) == "?"


def test_off_on_cpu_in_one_line(tmp_path, caplog, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = tmp_path / "memory_profile.json"
    profile = MemoryProfile(2, str(path))
    with caplog.at_level(logging.WARNING, logger="gspo_megatron.memory_profile"):
        profile.start()
        profile.step_done(2)
        profile.close()
    assert not profile.recording and not path.exists()
    assert [r.getMessage() for r in caplog.records] == [
        "logging.memory_profile_steps=2: the allocator history needs CUDA; off"]
    MemoryProfile(0, str(path)).start()  # off: not a word


def test_the_field_is_checked():
    from gspo_megatron.config import TrainConfig
    from gspo_megatron.config.validation import ConfigError, validate_config

    cfg = TrainConfig()
    cfg.logging.memory_profile_steps = -1
    with pytest.raises(ConfigError, match="logging.memory_profile_steps"):
        validate_config(cfg, check_paths=False)
