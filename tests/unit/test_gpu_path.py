"""Regression tests for the GPU path's failures that can be caught on CPU (issue 17).

Each names what would have stopped a first run on an H100 without Transformer Engine, flash-attn or
the grouped_gemm package (the image we are lent), reproduced here by pretending CUDA is present.
"""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.config import TrainConfig
from gspo_megatron.config.validation import ConfigError, validate_config


def test_router_gemm_fix_does_not_depend_on_cuda(monkeypatch):
    """megatron-core 0.16.1 reads ``te_general_gemm`` in the router whether or not TE imported.
    The fix used to sit in the CPU-only shims, so with CUDA but without TE every MoE forward
    would have raised NameError."""
    from megatron.core.transformer.moe import moe_utils

    from gspo_megatron.compat import apply_missing_te_compat

    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(NameError):
        moe_utils.router_gating_linear(torch.randn(3, 4), torch.randn(2, 4), None, torch.float32)
    assert apply_missing_te_compat() is True
    assert apply_missing_te_compat() is False  # idempotent
    x, w = torch.randn(3, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
    out = moe_utils.router_gating_linear(x, w, None, torch.float64)
    torch.testing.assert_close(out, x @ w.T)


def test_grouped_experts_only_where_a_grouped_kernel_exists(monkeypatch):
    """The local spec asked for ``moe_grouped_gemm`` on every GPU, which asserts in Megatron's
    GroupedMLP unless the grouped_gemm package is installed; TE's spec has its own kernel."""
    from megatron.core.transformer.moe import grouped_gemm_util

    from gspo_megatron.backends.megatron.model import (build_transformer_config,
                                                      grouped_gemm_available)
    from gspo_megatron.config.model import ParallelConfig, PrecisionConfig, model_config_from_preset

    assert grouped_gemm_available("local") is False  # no CUDA here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert grouped_gemm_available("transformer_engine") is True
    monkeypatch.setattr(grouped_gemm_util, "grouped_gemm_is_available", lambda: False)
    assert grouped_gemm_available("local") is False
    monkeypatch.setattr(grouped_gemm_util, "grouped_gemm_is_available", lambda: True)
    assert grouped_gemm_available("local") is True
    monkeypatch.setattr(grouped_gemm_util, "grouped_gemm_is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # build the config on CPU
    cfg = build_transformer_config(model_config_from_preset("tiny"), ParallelConfig(),
                                   PrecisionConfig(), impl="local")
    assert cfg.moe_grouped_gemm is False


def test_kv_budget_too_small_for_one_request_is_refused_before_anything_runs():
    """The dynamic engine runs on CPU too; a KV budget that cannot hold one request of
    model.seq_length tokens is refused by the config check, naming the field and the need."""
    cfg = TrainConfig()
    cfg.model.seq_length = 4096
    cfg.rollout.dynamic_buffer_size_gb = 1e-4
    with pytest.raises(ConfigError, match=r"rollout.dynamic_buffer_size_gb=0.0001 cannot hold one "
                                          r"request of model.seq_length=4096 tokens"):
        validate_config(cfg)
    cfg.rollout.dynamic_buffer_size_gb = None  # sized from max_batch_size
    validate_config(cfg)
    cfg.rollout.dynamic_buffer_size_gb = 1e-4
    cfg.rollout.engine = "static"  # no paged cache
    validate_config(cfg)


def test_rollout_engine_fields_are_checked():
    from gspo_megatron.config import RolloutConfig
    from gspo_megatron.sections import FieldError

    with pytest.raises(FieldError, match="rollout.dynamic_buffer_size_gb"):
        RolloutConfig(dynamic_buffer_size_gb=0)


def test_stage_timer_and_memory_metrics_on_cpu():
    from gspo_megatron.metrics import MemoryPeaks, Stopwatch

    watch = Stopwatch()
    assert watch.lap("perf/a") >= 0 and set(watch.total("perf/step_s")) == {"perf/a", "perf/step_s"}
    memory = MemoryPeaks()
    memory.phase("perf/rollout_peak_mem_gib")
    assert memory.metrics() == {}


def test_memory_peaks_are_per_phase_and_per_step(monkeypatch):
    """Each phase reports the peak since the previous one (the allocator's peak is reset at every
    boundary), the step's peak is the largest phase, and what came before the step (a checkpoint
    load) is in none of them. The CUDA allocator is stood in for by a counter."""
    from gspo_megatron.metrics import MemoryPeaks

    allocator = {"now": 0.0, "peak": 0.0}

    def allocate(gib):
        allocator["now"] += gib
        allocator["peak"] = max(allocator["peak"], allocator["now"])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: allocator["peak"] * 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda: allocator.update(peak=allocator["now"]))
    allocate(30.0), allocate(5.0), allocate(-5.0)  # the load's transient 5 GiB, before the step
    memory = MemoryPeaks()
    allocate(4.0), allocate(-4.0)  # KV cache during the rollout
    memory.phase("perf/rollout_peak_mem_gib")
    allocate(2.0), allocate(-2.0)  # activations during the updates
    memory.phase("perf/train_peak_mem_gib")
    assert memory.metrics() == {"perf/rollout_peak_mem_gib": 34.0,
                                "perf/train_peak_mem_gib": 32.0, "perf/peak_mem_gib": 34.0}


def test_gpu_check_reward_and_comparison(tmp_path):
    """tools/gpu_check.py's pieces that run without a GPU: its benchmark reward and the
    run-vs-resumed-run comparison."""
    import json

    from tools.gpu_check import compare_metrics, digit_share, stages

    assert digit_share("12 ab", "") == pytest.approx(0.5) and digit_share("  ", "") == 0.0
    for name, rows in (("a", [{"step": 0, "loss/policy": 1.0, "perf/step_s": 1.0}]),
                       ("b", [{"step": 0, "loss/policy": 1.5, "perf/step_s": 9.0}])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    cmp = compare_metrics(str(tmp_path / "a"), str(tmp_path / "b"))
    assert cmp["differ"] == 1 and cmp["max_abs_diff"] == pytest.approx(0.5)
    names = [s.name for s in stages(str(tmp_path), "quick")]
    assert names[:2] == ["env", "tiny_dynamic"] and "slice_mfu" in names
    assert {"tiny_r3", "tiny_r3_bf16_rollout", "tiny_packed", "cp2_cpu", "tiny_yarn",
            "tiny_separate_r3", "tiny_separate_buckets", "tiny_partial_r3", "tiny_offload",
            "slice_rl_offload"} <= set(names)
    offload = next(s for s in stages(str(tmp_path), "quick") if s.name == "slice_rl_offload")
    argv = offload.commands[0]
    assert "--trainer.offload=optimizer+grads" in argv  # the last run_dir (its own) wins
    assert [a for a in argv if a.startswith("--logging.run_dir=")][-1].endswith("slice_rl_offload")


def test_engine_choice():
    """``auto`` is the dynamic engine everywhere (expert-parallel ranks in lock-step, R3 from its
    packed buffer); neither engine pads pipeline-parallel ranks for EP lock-step."""
    from gspo_megatron.backends.megatron.engine.rollout import choose_backend

    assert choose_backend("auto") == "dynamic"
    assert choose_backend("auto", pp_size=1, ep_size=8) == "dynamic"
    assert choose_backend("auto", pp_size=4, ep_size=1) == "dynamic"
    assert choose_backend("static", ep_size=2) == "static"
    with pytest.raises(NotImplementedError, match="pipeline_model_parallel_size=2 with "
                                                  "expert_model_parallel_size=2"):
        choose_backend("auto", pp_size=2, ep_size=2)


def test_every_training_stage_of_gpu_check_is_a_valid_config(tmp_path):
    """A stage whose overrides the config refuses would spend a lent GPU's minutes on a one-line
    error: every ``gspo-train`` command of ``tools/gpu_check`` (plain or under torchrun) loads and
    passes the cross-section checks here, at its world size."""
    from gspo_megatron.config import DEMO_RECIPE
    from gspo_megatron.config.loader import load_config, parse_command_line
    from gspo_megatron.config.validation import validate_config
    from tools.gpu_check import stages

    from gspo_megatron.backends.megatron.policy import lr_schedule
    from gspo_megatron.cli import rl_optimizer_steps

    checked, resumed = [], []
    for size in ("smoke", "quick", "full"):
        for stage in stages(str(tmp_path), size):
            name = stage.name
            schedules: dict[str, list] = {}
            for command in stage.commands:
                if "gspo_megatron.cli" not in command:
                    continue
                args = parse_command_line(command[command.index("gspo_megatron.cli") + 1:])
                world = (int(command[command.index("--nproc-per-node") + 1])
                         if "--nproc-per-node" in command else 1)
                cfg = load_config(args.config or DEMO_RECIPE, args.overrides)
                validate_config(cfg, world_size=world, check_paths=False)
                checked.append(name)
                schedules.setdefault(cfg.logging.run_dir, []).append(
                    repr(lr_schedule(cfg.optim, rl_optimizer_steps(cfg))))
            _schedules_of_resumed_runs(stage, schedules)
            resumed += [name for found in schedules.values() if len(found) > 1]
    assert {"tiny_dynamic", "tiny_partial_r3", "tiny_partial_keep_kv_r3",
            "tiny_separate_r3", "tiny_separate_buckets"} <= set(checked)
    assert set(resumed) >= {"slice_rl", "tiny_resume", "tiny_resume_sync"}


def _schedules_of_resumed_runs(stage, schedules: dict) -> None:
    """A stage command that resumes an earlier one's run directory must have its LR schedule
    (else ``gspo-train`` refuses to resume: slice_rl's did on the H200 on 2026-11-27)."""
    for run_dir, found in schedules.items():
        assert len(set(found)) == 1, (stage.name, run_dir, found)


def test_plan_against_measured_peaks():
    """``tools/gpu_check`` reads ``gspo-plan``'s two peaks off its printed table and sets the
    run's largest measured peak of each phase against them."""
    from tools.gpu_check import plan_vs_measured

    plan = ("  training peak                       33.17 GiB\n"
            "  rollout peak                        35.32 GiB\n"
            "  total (larger peak)                 35.32 GiB\n")
    figures = {"perf/train_peak_mem_gib": [30.1, 31.0], "perf/rollout_peak_mem_gib": [38.36]}
    out = plan_vs_measured(plan, figures)
    assert out["training"]["measured_gib"] == 31.0 and out["training"]["planned_gib"] == 33.17
    assert out["rollout"]["measured_over_planned"] == pytest.approx(38.36 / 35.32)
    assert plan_vs_measured(plan, {}) == {}


def test_gpu_check_runs_named_stages_in_the_order_named(tmp_path):
    """``--only`` is the run order (the most informative first under a deadline): consecutive
    untimed stages share one wave, timed ones run alone; ``--size-for`` sizes one stage apart;
    an unknown stage or size is refused naming it."""
    from tools.gpu_check import plan_waves, select_stages

    todo = select_stages(str(tmp_path), "full", "env,decode_probe,tiny_dynamic,tiny_repeat,"
                         "slice_mfu,slice_plan,slice_rl", "slice_rl=smoke")
    assert [s.name for s in todo] == ["env", "decode_probe", "tiny_dynamic", "tiny_repeat",
                                      "slice_mfu", "slice_plan", "slice_rl"]
    waves = plan_waves(todo, parallel=4, ordered=True)
    assert [[s.name for s in w] for w in waves] == [
        ["env"], ["decode_probe"], ["tiny_dynamic", "tiny_repeat"], ["slice_mfu"],
        ["slice_plan"], ["slice_rl"]]
    smoke_rl = {s.name: s for s in select_stages(str(tmp_path), "smoke")}["slice_rl"]
    assert todo[-1].commands == smoke_rl.commands  # sized apart from --size full
    full_rl = {s.name: s for s in select_stages(str(tmp_path), "full")}["slice_rl"]
    assert full_rl.commands != smoke_rl.commands
    # Unordered: every untimed stage in a first wave, then the timed ones alone.
    unordered = plan_waves(todo, parallel=4)
    assert [s.name for s in unordered[0]] == ["env", "tiny_dynamic", "tiny_repeat", "slice_plan"]
    assert all(len(w) == 1 and w[0].timed for w in unordered[1:])
    assert [[s.name] for s in todo] == [[s.name for s in w] for w in plan_waves(todo, 1)]
    with pytest.raises(SystemExit, match="tiny_dynmic"):
        select_stages(str(tmp_path), "full", "tiny_dynmic")
    with pytest.raises(SystemExit, match="slice_rl=huge"):
        select_stages(str(tmp_path), "full", None, "slice_rl=huge")
