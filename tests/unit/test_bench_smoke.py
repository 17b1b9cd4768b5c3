"""Smoke test of the benchmark code (tools/bench): every benchmark runs at toy sizes in this
process and produces a well-formed record, table and JSON report. Timings are not checked."""

import json
import re

import pytest

pytest.importorskip("psutil")
pytest.importorskip("transformers")

from tools.bench import BENCHMARKS  # noqa: E402
from tools.bench.__main__ import format_table, main  # noqa: E402
from tools.bench.common import validate_result  # noqa: E402

pytestmark = pytest.mark.slow  # builds Megatron models (make test-fast skips it)


def _warm_run(argv: list[str], nproc: int, timeout: float) -> dict:
    """``python argv`` on ``nproc`` ranks forked from the suite's warm interpreter
    (tests/helpers/warm.py); its last JSON line. The same process as a cold launch, without
    ~10 s of imports (a cold launch is what ``make bench`` runs)."""
    import os

    from tests.helpers import warm

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=root, OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    proc = warm.run(argv, env=env, cwd=root, nproc=nproc, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1])


def _warm_layout(module: str, spec: dict, nproc: int, timeout: float = 1800) -> dict:
    """``common.run_layout``: the same ``--child`` on the same ranks, warm."""
    return _warm_run(["-m", module, "--child", json.dumps(spec)], nproc, timeout)


def _warm_child(module: str, args: list[str], timeout: float = 900) -> dict:
    """``common.run_child`` (``python -m module args`` in a fresh process), warm."""
    return _warm_run(["-m", module, *args], 1, timeout)


def _warm_cli(args: list[str], nproc: int, timeout: float = 1800, bind_cores: bool = False) -> None:
    """``common.run_cli`` forked from the warm interpreter (as :func:`_warm_layout`; cores not
    bound: a smoke run checks the code, not timings)."""
    from tests.e2e.test_train_e2e import ROOT, clean_env
    from tests.helpers import warm

    proc = warm.run(["-m", "gspo_megatron.cli", *args], env=clean_env(None), cwd=ROOT,
                    nproc=nproc, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_every_benchmark_runs_at_toy_size(tmp_path, monkeypatch):
    from tools.bench import common

    monkeypatch.setattr(common, "run_layout", _warm_layout)
    monkeypatch.setattr(common, "run_cli", _warm_cli)
    monkeypatch.setattr(common, "run_child", _warm_child)
    out = tmp_path / "bench.json"
    rc = main(["--smoke", "--in-process", "--out", str(out)])
    report = json.loads(out.read_text())
    errors = [r for r in report["benchmarks"] if r.get("error")]
    assert rc == 0 and not errors, errors
    assert [r["name"] for r in report["benchmarks"]] == list(BENCHMARKS)
    assert report["schema"] == 1 and report["smoke"] is True and "machine" in report
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?|unknown", report["commit"])  # figures name their code
    for res in report["benchmarks"]:
        validate_result(res)
        assert all(isinstance(v, (int, float)) for v in res["ratios"].values())
    by_name = {r["name"]: r for r in report["benchmarks"]}
    assert {"train_time_ours_vs_naive", "train_mem_ours_x_logits"} <= set(by_name["logprobs"]["ratios"])
    assert "gspo_vs_ce" in by_name["update_step"]["ratios"]
    assert {"diag_vs_off", "diag_every_vs_off_full_step"} <= set(by_name["routing"]["ratios"])
    assert {"rollout_record_vs_plain_tiny", "train_r3_vs_off_fine32"} <= set(by_name["r3_cost"]["ratios"])
    same = [r["value"] for r in by_name["r3_cost"]["rows"] if "same tokens" in r["metric"]]
    assert same == [1.0, 1.0]  # recording routes does not change what is sampled
    assert "ours_vs_hf_tokens_per_s_batch2" in by_name["rollout"]["ratios"]
    # the long tail in a training run: every phase heavy-tailed vs uniform, and the bound
    assert {"heavy_rollout_vs_uniform", "heavy_training_vs_uniform", "partial_rollout_vs_uniform",
            "partial_rollout_per_decoded_vs_uniform",
            "rollout_bound"} <= set(
        by_name["long_tail_run"]["ratios"]) and by_name["long_tail_run"]["met"] is None
    # long-tailed vs uniform cost per real token, both engines, one process and EP=2 (2 ranks)
    assert {"ep1_dynamic", "ep1_static", "ep2_dynamic", "ep2_static", "ep1_dynamic_slots4",
            "ep2_dynamic_slots4", "ep1_dynamic_per_step",
            "ep2_dynamic_per_step"} <= set(by_name["long_tail"]["ratios"])
    # training per real token, long-tailed vs uniform, padded and packed microbatches, one
    # process and EP=2 (2 ranks); the synthetic reasoning-RL batch's tokens computed / real
    assert {"ep1_padded", "ep1_packed", "ep2_padded", "ep2_packed", "synthetic_padded",
            "synthetic_packed"} <= set(by_name["packing"]["ratios"])
    assert by_name["packing"]["met"] is None and by_name["packing"]["ratios"]["synthetic_packed"] <= 1.05
    assert by_name["rollout"]["rows"][-1]["value"] == 1.0  # greedy tokens identical to HF's
    assert by_name["rl_step"]["met"] is None and by_name["rl_step"]["rows"]
    assert {"critical_path_async_over_sync", "step_async_over_sync"} <= set(by_name["checkpoint"]["ratios"])
    assert {"demo", "demo_bound"} <= set(by_name["overlap"]["ratios"]) and by_name["overlap"]["met"] is None
    assert any(r["metric"].startswith("ours n=2 G=2") for r in by_name["scaling"]["rows"])
    gpu = by_name["gpu_qwen3_slice"]
    assert gpu["met"] is None
    if "CPU code-path check" in gpu["rows"][-1]["metric"]:  # no CUDA: the slice code ran on CPU
        assert gpu["rows"][-1]["value"] > 0
    zero = {r["metric"]: r["value"] for r in by_name["zero_mismatch"]["rows"]}
    assert zero["mismatch/tokens_differ, mode on (last round)"] == 0
    table = format_table(report)
    for name in BENCHMARKS:
        assert name in table


def test_trl_peer_without_trl_says_how_to_install_it(monkeypatch):
    from tools.bench import trl_peer

    monkeypatch.setattr(trl_peer, "trl_available", lambda: None)
    res = trl_peer.run(smoke=True)
    validate_result(res)
    assert res["met"] is None and "pip install -e '.[bench]'" in res["rows"][0]["value"]


def test_validate_result_rejects_malformed():
    with pytest.raises(ValueError):
        validate_result({"name": "x"})
    good = {"name": "x", "title": "", "target": "", "met": None, "ratios": {}, "config": {},
            "notes": [], "seconds": 0.0, "rows": [{"metric": "m", "value": 1.0, "unit": "s"}]}
    validate_result(good)
    with pytest.raises(ValueError):
        validate_result(dict(good, rows=[{"metric": "m", "value": [1]}]))


@pytest.mark.parametrize("preset", ["tiny", "qwen3-30b-a3b"])
def test_gpu_slice_flop_count_matches_the_parameter_count(preset):
    """The GPU benchmark's MFU numerator: at sequence length 0 (no attention scores) a token's
    training FLOPs are 6 x the matmul parameters it uses (attention projections, routers, top-k
    experts, dense MLPs, LM head), counted independently by model/params.py; each extra position
    adds 3 x 2 x 2 x (heads x head_dim) / 2 per layer (causal QK^T and AV)."""
    from gspo_megatron.config.model import model_config_from_preset
    from gspo_megatron.params import count_parameters
    from tools.bench.gpu_qwen3_slice import model_flops_per_token

    cfg = model_config_from_preset(preset, num_layers=4, moe_layer_freq=[1, 0, 1, 1])
    c = count_parameters(cfg)
    qk_norms = cfg.num_layers * 2 * cfg.head_dim()
    lm_head = cfg.padded_vocab_size() * cfg.hidden_size
    matmul_params = c.attention - qk_norms + c.dense_mlp + c.routers + c.active_experts + lm_head
    assert model_flops_per_token(cfg, 0) == 6 * matmul_params
    q = cfg.num_attention_heads * cfg.head_dim()
    per_position = 3 * cfg.num_layers * 2 * q
    assert model_flops_per_token(cfg, 100) - model_flops_per_token(cfg, 0) == 100 * per_position


def test_gpu_rollout_bench_runs_its_gpu_code_on_cpu():
    """``tools/gpu_check``'s rollout stage at toy size on CPU (the tiny preset, fp32): every
    engine path of both model variants is timed and profiled, the decoding steps counted agree
    with what was generated, and greedy tokens are the same on every dynamic path (CPU: the
    graph path runs eagerly)."""
    from tools.bench.gpu_rollout import ENGINES, PROFILE_TOKENS, run

    res = run("smoke", tiny=True)
    greedy = res["greedy_tokens_equal"]
    assert {v for k, v in greedy.items() if "/" not in k} == {0}, greedy  # requests differing
    assert all(v < 1e-4 for k, v in greedy.items() if k.endswith("/logprob_max_abs_diff"))
    assert res["decode_limit"]["weight_bytes"] > 0
    for variant in ("megatron_modules", "our_kernels"):
        for engine in ENGINES:
            if variant == "megatron_modules" and engine.startswith("dynamic_rounds"):
                continue
            rec = res[f"{variant}/{engine}"]
            assert "error" not in rec, rec
            assert rec["tokens"] > 0 and rec["tokens_per_s"][0] > 0
            prof = rec["profile"]
            assert 1 <= prof["decode_steps"] <= PROFILE_TOKENS
            assert prof["ops_per_unit"] > 0 and prof["top_host"], prof


def test_gpu_decode_check_runs_its_gpu_code_on_cpu():
    """``tools/gpu_check``'s ``decode_build`` stage on CPU (the local spec, fp32): the step
    function covers the build, decodes Megatron's forward's greedy tokens, and the attention's
    SDPA kernel is named."""
    from tools.bench.gpu_decode import run

    res = run(batch=4, new=6)
    assert res["unsupported"] is None, res
    assert res["megatron_forward"]["decode_path"] == 0.0
    assert res["rounds_eager"]["decode_path"] == 1.0
    assert res["greedy_equal"] == {"rounds_eager": True, "rounds_graphs": True}, res
    assert res["attention_backend"] in ("flash_attention", "math", "efficient_attention"), res


def test_gpu_slice_profiles_its_step_on_cpu():
    """The MFU stage's profiled step runs on CPU (host columns only) and the profile's totals are
    the sums of its rows; device kernels are split by name into GEMM, attention and the rest."""
    from tools.bench.gpu_qwen3_slice import _cpu_code_path_check, _profile_rows
    from tools.bench.profiling import kernel_kind

    prof = _cpu_code_path_check()["profile"]
    assert prof["units"] == 1 and prof["ops_per_unit"] > 0 and prof["top_host"]
    assert 0 < prof["host_us_per_unit"] and prof["wall_us_per_unit"] > 0
    assert prof["device_us_per_unit"] == 0 and not any(prof["device_by_kind_us_per_unit"].values())
    assert {r["op"] for r in prof["top_host"]} & {"aten::mm", "aten::addmm", "aten::_grouped_mm",
                                                  "aten::bmm", "aten::linear"}
    assert [r["metric"] for r in _profile_rows("x", prof)] == ["x: device busy / wall (profiled step)"]
    # Kernel names as an H100 / H200 profile shows them.
    assert kernel_kind("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT") == "gemm"
    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert kernel_kind("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm90"
                       "<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape"
                       ">>>") == "gemm"
    assert kernel_kind("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, "
                       "64, 4, false, false, cutlass::bfloat16_t>>") == "attention"
    assert kernel_kind("fmha_cutlassB_bf16_aligned_64x64_k128_sm80") == "attention"
    assert kernel_kind("void at::native::vectorized_elementwise_kernel<4, at::native::"
                       "CUDAFunctor_add<c10::BFloat16>>") == "other"
    fake = {"device_us_per_unit": 80.0, "wall_us_per_unit": 100.0,
            "device_by_kind_us_per_unit": {"attention": 20.0, "gemm": 40.0, "other": 20.0}}
    assert [r["value"] for r in _profile_rows("x", fake)] == [0.8, 0.25, 0.5, 0.25]


def test_profile_summary_counts_each_kernel_once():
    """A host op's row carries its kernels' device time as its own self device time too; the
    device totals, the split by kind and the device table take the kernel rows only."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from tools.bench.profiling import summarize

    def ev(key, device, host_us, device_us, count=1):
        return SimpleNamespace(key=key, device_type=device, count=count,
                               self_cpu_time_total=host_us, self_device_time_total=device_us)

    rows = [ev("aten::addmm", DeviceType.CPU, 30.0, 500.0, 2),
            ev("aten::_efficient_attention_forward", DeviceType.CPU, 20.0, 300.0),
            ev("aten::item", DeviceType.CPU, 5.0, 0.0, 4),
            ev("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", DeviceType.CUDA, 0.0, 500.0, 2),
            ev("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", DeviceType.CUDA, 0.0, 300.0),
            ev("void at::native::vectorized_elementwise_kernel<4>", DeviceType.CUDA, 0.0, 200.0)]
    out = summarize(rows, n=2, wall=0.001)
    assert out["device_us_per_unit"] == 500.0 and out["wall_us_per_unit"] == 500.0
    assert out["device_by_kind_us_per_unit"] == {"attention": 150.0, "gemm": 250.0, "other": 100.0}
    assert out["host_us_per_unit"] == 27.5 and out["ops_per_unit"] == 3.5
    assert out["waits_per_unit"] == {"aten::item": 2.0}
    assert [r["op"] for r in out["top_device"]][0].startswith("nvjet")
    assert all(not r["op"].startswith("aten::") for r in out["top_device"])
    assert out["top_host"][0]["op"] == "aten::addmm"


def test_the_long_tail_bound_of_the_step_costs():
    """The bound of tools.bench.long_tail_run: a batch whose responses all have the same length
    costs what the uniform one does; the issue's heavy tail (mean 17.6, longest 94 of 128, step
    0.38 / 1.65 ms at batch 1 / 128) cannot cost less than ~1.9x."""
    from tools.bench.long_tail_run import bound

    assert bound(20.0, 20.0, 128, 0.38, 1.65) == pytest.approx(1.0, abs=1e-12)
    assert 1.9 < bound(17.6, 94, 128, 0.38, 1.65) < 2.0
    assert bound(17.6, 94, 128, 1.65, 1.65) == pytest.approx(94 / 17.6)  # GPU-like: flat cost
