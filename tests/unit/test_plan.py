"""gspo-plan: memory of a layout from exact per-rank parameter counts; bad layouts refused; the
model's parameter counts; a recipe (plus gspo-train overrides) as the source of the layout."""

import os
import subprocess
import sys
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest
import torch

from gspo_megatron.config.model import model_config_from_preset
from gspo_megatron.params import count_parameters
from gspo_megatron.planner import (GIB, HEADROOM, Layout, headroom, params_per_rank, plan_memory,
                                   route_bytes_per_token, route_id_bytes, suggest_layouts)
from gspo_megatron.tools import plan as plan_tool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = os.path.join(ROOT, "examples", "configs")
TOOLS = {"gspo-convert-hf": "convert_hf", "gspo-export-hf": "export_hf", "gspo-plan": "plan",
         "gspo-routing-report": "routing_report"}


@pytest.fixture
def plan(capsys):
    """Run gspo-plan's main in this process (a subprocess pays torch's import each time):
    ``plan(*argv)`` -> returncode, stdout, stderr."""

    def run(*args):
        try:
            rc = plan_tool.main(list(args))
        except SystemExit as exc:  # argparse errors, SystemExit("message")
            rc = exc.code if isinstance(exc.code, int) else 1
            if isinstance(exc.code, str):
                print(exc.code, file=sys.stderr)
        out, err = capsys.readouterr()
        return SimpleNamespace(returncode=rc, stdout=out, stderr=err)

    return run


@pytest.mark.parametrize("layout", [Layout(), Layout(tp=2), Layout(ep=4), Layout(pp=2), Layout(tp=2, ep=2, pp=2)])
def test_shards_add_up_to_the_model(layout):
    """Summed over the ranks of one replica, the per-rank counts are the model's parameters
    (replicated tensors — norms, routers — counted once per TP rank)."""
    model = model_config_from_preset("qwen3-30b-a3b")
    total = 0
    for stage in range(layout.pp):
        dense, expert = params_per_rank(model, layout, stage)
        total += dense * layout.tp + expert * layout.ep * layout.etp
    c = count_parameters(model)
    replicated = (2 * model.num_layers + 1) * model.hidden_size + c.routers \
        + 2 * model.head_dim() * model.num_layers
    assert total == c.total + (layout.tp - 1) * replicated


def test_bytes_follow_the_counts():
    model = model_config_from_preset("qwen3-30b-a3b")
    p = plan_memory(model, Layout(tp=2, ep=8), 16, seq_length=4096)
    assert p.weights == 2 * p.params_per_gpu and p.grads == 4 * p.params_per_gpu
    dense_dp, expert_dp = 8, 1  # ETP defaults to TP=2: 16 GPUs / (EP 8 x ETP 2)
    assert p.optimizer == int(12 * p.dense_params_per_gpu / dense_dp + 12 * p.expert_params_per_gpu / expert_dp)
    assert 30 * GIB < p.total < 60 * GIB


def test_cli_refuses_bad_layouts_and_models(plan):
    bad = plan("--model", "qwen3-30b-a3b", "--gpus", "16", "--tp", "3", "--ep", "8")
    assert bad.returncode == 2 and "world size 16 is not divisible" in bad.stderr
    assert "layouts that fit" in bad.stderr
    experts = plan("--model", "qwen3-30b-a3b", "--gpus", "24", "--ep", "24")
    assert experts.returncode == 2 and "num_moe_experts (128) is not divisible" in experts.stderr
    unknown = plan("--model", "qwen9", "--gpus", "8")
    assert unknown.returncode != 0 and "unknown model 'qwen9'" in unknown.stderr
    too_big = plan("--model", "qwen3-235b-a22b", "--gpus", "8", "--ep", "8", "--gpu-memory", "80")
    assert too_big.returncode == 3 and "does not fit" in too_big.stderr
    ok = plan("--model", "qwen3-30b-a3b", "--gpus", "16", "--tp", "2", "--ep", "8")
    assert ok.returncode == 0 and "TP2 PP1 EP8" in ok.stdout


def test_suggestions_fit():
    """Every suggestion fits; those leaving the headroom come first."""
    model = model_config_from_preset("qwen3-235b-a22b")
    plans = suggest_layouts(model, 128, 80, seq_length=4096, limit=50)
    assert plans and all(p.total <= 80 * GIB for p in plans)
    roomy = [headroom(p, 80) >= HEADROOM for p in plans]
    assert roomy == sorted(roomy, reverse=True)


@pytest.mark.parametrize("name,gpus,scale,suffix", [("qwen3-30b-a3b", 16, 1e9, "B"),
                                                     ("tiny", 1, 1e3, "K")])
def test_cli_prints_total_and_active_parameters(plan, name, gpus, scale, suffix):
    """The line above the table: count_parameters' total and per-token active counts, 3 digits."""
    c = count_parameters(model_config_from_preset(name))
    args = ["--model", name, "--gpus", str(gpus)] + (["--ep", "8", "--tp", "2"] if gpus > 1 else [])
    p = plan(*args)
    assert p.returncode == 0, p.stderr
    first = p.stdout.splitlines()[0]
    assert first == (f"{name}: {c.total / scale:.3g}{suffix} parameters, "
                     f"{c.active / scale:.3g}{suffix} active per token")
    assert p.stdout.splitlines()[1].startswith("layout ")
    if name == "tiny":  # 140,160 parameters, 91,008 of them used per token (2 of 4 experts)
        assert (c.total, c.active) == (140_160, 91_008)
        assert first == "tiny: 140K parameters, 91K active per token"
    else:
        assert first == "qwen3-30b-a3b: 30.5B parameters, 3.35B active per token"


def test_format_count():
    fmt = plan_tool.format_count
    assert [fmt(n) for n in (999, 1_000, 91_008, 999_999, 2_500_000, 235_093_634_560, 1.04e12)] == \
        ["999", "1K", "91K", "1M", "2.5M", "235B", "1.04T"]


def test_recipe_is_the_layout_source(plan):
    """--config reads the recipe and gspo-train's overrides (both spellings); --print-layout gives
    'TP PP EP ETP CP' on stdout, the report on stderr."""
    tiny = os.path.join(RECIPES, "tiny_gspo.yaml")
    p = plan("--gpus", "2", "--config", tiny, "--print-layout")
    assert p.returncode == 0 and p.stdout == "1 1 1 1 1\n", p.stderr
    assert "tiny: 140K parameters" in p.stderr and "layout TP1 PP1 EP1 ETP1 CP1 DP2" in p.stderr
    p = plan("--gpus", "4", "--print-layout", "--recipe", tiny,
             "--parallel.expert_model_parallel_size", "2", "--parallel.tensor_model_parallel_size=2")
    assert p.returncode == 0 and p.stdout == "2 1 2 2 1\n", p.stderr
    # Printed even when the check fails, so a script can name the layout it refuses.
    p = plan("--gpus", "2", "--print-layout", "--config", tiny, "--parallel.expert_model_parallel_size=3")
    assert p.returncode == 2 and p.stdout == "1 1 3 1 1\n" and "must divide" in p.stderr
    # The recipe's micro-batch, sequence length and precision are what is planned.
    p = plan("--gpus", "1", "--config", tiny, "--trainer.micro_batch_size=1", "--model.seq_length=4096",
             "--trainer.pack_sequences=false")
    # ... and its rollout batch (16 prompts x 8 x (8 + 4) tokens), whose routes R2/R3 keep, and
    # the KV cache of rollout.max_batch_size (256) requests of model.seq_length tokens.
    q = plan("--gpus", "1", "--fp32", "--model", "tiny", "--seq-length", "4096", "--recompute", "none",
             "--rollout-tokens", str(16 * 8 * (8 + 4)), "--rollout-requests", "256")
    assert p.returncode == q.returncode == 0
    # (a recipe adds the fast decoder's lines, rollout.decode_steps_per_sync: its own test)
    assert "".join(line for line in p.stdout.splitlines(True) if "decode" not in line) == q.stdout


@pytest.mark.parametrize("recipe,gpus,layout", [("qwen3_30b_a3b_gspo.yaml", 8, "4 1 8 1 1"),
                                                ("qwen3_30b_a3b_grpo.yaml", 8, "4 1 8 1 1"),
                                                ("qwen3_30b_a3b_gspo.yaml", 16, "4 1 8 1 1"),
                                                ("qwen3_30b_a3b_gspo_16k.yaml", 16, "4 1 8 1 1"),
                                                ("qwen3_235b_a22b_gspo.yaml", 128, "4 1 64 1 1")])
def test_shipped_recipes_fit_their_launch_size(plan, recipe, gpus, layout):
    """What launch/submit.sh checks for the two real models (launch/models/*.sh GPU counts):
    the 30B recipes on one node of 8 x 80 GB, with the offload; the verdict in one line."""
    p = plan("--gpus", str(gpus), "--config", os.path.join(RECIPES, recipe), "--print-layout")
    assert p.returncode == 0 and p.stdout == layout + "\n", p.stderr
    verdict = [line for line in p.stderr.splitlines() if line.startswith("plan: ")]
    assert len(verdict) == 1 and verdict[0].startswith("plan: fits: "), p.stderr


def test_offload_in_the_plan(plan):
    """trainer.offload takes Adam's moments (8 of the optimizer's 12 bytes a parameter), the
    gradients and, with ``all``, the main copy (bf16) out of the rollout peak only; the 30B
    recipe on 8 GPUs does not fit without it."""
    model = model_config_from_preset("qwen3-30b-a3b")
    layout, kw = Layout(tp=4, ep=8, etp=1), dict(seq_length=5120, rollout_requests=128,
                                                 max_tokens_per_microbatch=10240)
    plans = {o: plan_memory(model, layout, 8, offload=o, **kw)
             for o in ("none", "optimizer", "optimizer+grads", "all")}
    none = plans["none"]
    assert {p.training_peak for p in plans.values()} == {none.training_peak}
    assert plans["optimizer"].offloaded == pytest.approx(none.optimizer * 8 / 12, abs=2)
    assert plans["optimizer+grads"].offloaded == pytest.approx(
        none.optimizer * 8 / 12 + none.grads, abs=2)
    assert plans["all"].offloaded == pytest.approx(none.optimizer + none.grads, abs=2)
    for p in plans.values():
        assert p.rollout_peak == p.state - p.offloaded + p.kv_cache
    fp32 = plan_memory(model, layout, 8, offload="all", bf16=False, **kw)
    assert fp32.offloaded == pytest.approx(fp32.optimizer * 8 / 12 + fp32.grads, abs=2)
    recipe = os.path.join(RECIPES, "qwen3_30b_a3b_gspo.yaml")
    out = plan("--gpus", "8", "--config", recipe)
    assert out.returncode == 0 and "offloaded (optimizer+grads)" in out.stdout
    rollout = float(out.stdout.split("rollout peak")[1].split()[0])
    assert rollout < 40  # 36.73 GiB: weights, the main copy, the KV cache
    off = plan("--gpus", "8", "--config", recipe, "--trainer.offload=none")
    assert off.returncode == 3 and "does not fit" in off.stderr


def test_recipe_mode_refuses_flags_and_bad_overrides(plan):
    tiny = os.path.join(RECIPES, "tiny_gspo.yaml")
    p = plan("--gpus", "2", "--config", tiny, "--ep", "2", "--fp32")
    assert p.returncode != 0
    assert "--parallel.expert_model_parallel_size=N" in p.stderr and "--precision.bf16=false" in p.stderr
    p = plan("--gpus", "2", "--config", tiny, "--parallel.tensor_size=2")
    assert p.returncode == 2 and "parallel.tensor_size: unknown field" in p.stderr and p.stdout == ""
    p = plan("--gpus", "2", "--parallel.tensor_model_parallel_size=2")
    assert p.returncode == 2 and "overrides need --config" in p.stderr


def test_console_scripts():
    """Every tool is a console script of the installed package, and `python -m` runs it too."""
    scripts = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    for name, module in TOOLS.items():
        assert scripts.get(name) == f"gspo_megatron.tools.{module}:main", (name, scripts.get(name))
    proc = subprocess.run([sys.executable, "-m", "gspo_megatron.tools.plan", "--model", "tiny",
                           "--gpus", "2", "--ep", "2", "--fp32"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0 and proc.stdout.startswith("tiny: 140K parameters"), proc.stderr


@pytest.mark.parametrize("recipe,gpus,per_token,moe_layers", [
    ("qwen3_30b_a3b_gspo.yaml", 16, 384, 48), ("qwen3_235b_a22b_gspo.yaml", 128, 752, 94)])
def test_route_memory_of_the_qwen3_recipes(plan, recipe, gpus, per_token, moe_layers):
    """R2/R3 keep the routes on the host: top-k ids x 1 byte (128 experts <= 256) x MoE layers
    per token; per rank, one copy of the rollout batch (prompts x G x (max prompt + max new
    tokens)) over its pipeline stage's MoE layers and its sequence-parallel shard (TP)."""
    from gspo_megatron.config.loader import load_config

    cfg = load_config(os.path.join(RECIPES, recipe))
    m, p, r = cfg.model, cfg.parallel, cfg.rollout
    assert (sum(m.layer_is_moe()), m.num_moe_experts, m.moe_router_topk) == (moe_layers, 128, 8)
    assert route_bytes_per_token(m) == m.moe_router_topk * 1 * moe_layers == per_token
    tokens = r.prompts_per_step * r.group_size * (cfg.data.max_prompt_length + r.max_new_tokens)
    per_rank = tokens * per_token // (p.pipeline_model_parallel_size * p.tensor_model_parallel_size)
    # (routing replay at TP > 1 trains padded microbatches: gspo-train refuses a packed budget)
    out = plan("--gpus", str(gpus), "--config", os.path.join(RECIPES, recipe), "--routing.replay=r3",
               "--trainer.max_tokens_per_microbatch=null")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert f"routes per token (host, R2/R3) {per_token} B (routing replay on)" in text
    assert (f"routes of a rollout batch {per_rank / 2**20:.2f} MiB per rank per copy "
            f"({tokens:,} tokens; host)") in text
    # 30B: 16 x 16 x 5120 tokens x 384 B / TP 4 = 120 MiB; 235B: 2 x 16 x 5120 x 752 B / (PP 1 x TP 4)
    assert per_rank == {384: 120 * 2**20, 752: 30_801_920}[per_token]
    layout = Layout(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                    ep=p.expert_model_parallel_size, etp=p.expert_tensor_parallel_size)
    on = plan_memory(m, layout, gpus, rollout_tokens=tokens, routing_replay=True)
    off = plan_memory(m, layout, gpus, rollout_tokens=tokens)
    assert on.routing_replay == per_rank and on.route_bytes_per_token == per_token
    assert on.total == off.total  # host memory: not in the per-GPU total


def test_route_id_bytes_follow_the_route_store_dtype():
    from gspo_megatron.routing.stats import route_dtype

    for experts in (4, 128, 256, 257, 65536, 65537):
        assert route_id_bytes(experts) == route_dtype(experts).itemsize
    wide = model_config_from_preset("qwen3-30b-a3b", num_moe_experts=512)
    assert route_bytes_per_token(wide) == 8 * 2 * 48


def test_rollout_and_training_peaks_are_separate(plan):
    """The KV cache is released while the trainer runs (rollout.dynamic_buffer_size_gb), so the
    per-GPU peak is the larger of the two phases, not their sum."""
    m = model_config_from_preset("qwen3-30b-a3b")
    layout = Layout(tp=2, ep=8)
    p = plan_memory(m, layout, 16, rollout_requests=64)
    per_token = 2 * 48 * (4 // 2) * 128 * 2  # K and V, 48 layers, 4 KV heads / TP 2, bf16
    assert m.seq_length == 4096  # 16 blocks of 256 tokens per request, + Megatron's dummy block
    assert p.kv_cache == (64 * 16 + 1) * 256 * per_token
    assert p.rollout_peak == p.weights + p.grads + p.optimizer + p.kv_cache
    assert p.training_peak == p.weights + p.grads + p.optimizer + p.activations + p.logits
    assert p.total == max(p.rollout_peak, p.training_peak) < p.training_peak + p.kv_cache
    assert plan_memory(m, layout, 16, kv_cache_bytes=2 * GIB).kv_cache == 2 * GIB


@pytest.mark.parametrize("layout,recompute", [(Layout(tp=2, ep=8), "full"), (Layout(ep=4), None),
                                              (Layout(tp=2, pp=2), "selective"),
                                              (Layout(tp=2, ep=4, cp=2), "selective")])
@pytest.mark.parametrize("b", [1, 2, 4])
def test_packed_budget_of_s_times_b_is_the_padded_microbatch(layout, recompute, b):
    """trainer.max_tokens_per_microbatch = s * b plans exactly b padded sequences of s tokens:
    the same tokens, and T * min(s, T) = s * b * s attention pairs (b = 1: one sequence in the
    row). Everything else is the padded plan's."""
    m = model_config_from_preset("qwen3-30b-a3b")
    s = 4096
    padded = plan_memory(m, layout, 16, micro_batch_size=b, seq_length=s, recompute=recompute)
    packed = plan_memory(m, layout, 16, seq_length=s, recompute=recompute,
                         max_tokens_per_microbatch=s * b)
    assert (packed.activations, packed.logits) == (padded.activations, padded.logits)
    assert packed.total == padded.total and packed.state == padded.state
    assert packed.microbatch_tokens == padded.microbatch_tokens == s * b
    assert padded.describe_microbatch() == f"{b} x 4,096 tokens, padded"
    assert packed.describe_microbatch() == f"{s * b:,} tokens, packed (sequences <= 4,096)"


def test_packed_activations_follow_the_budget():
    """Below s * b a packed microbatch costs less: linearly in the budget while it holds a whole
    sequence (T >= s: the attention pairs T * s are linear too), quadratically in the attention
    term below s (T * T pairs); the state and the KV cache do not move."""
    m = model_config_from_preset("qwen3-30b-a3b")
    layout, s = Layout(tp=2, ep=8), 4096

    def mem(recompute=None, **kw):
        return plan_memory(m, layout, 16, seq_length=s, recompute=recompute, **kw)

    padded = mem(micro_batch_size=4)
    half = mem(max_tokens_per_microbatch=2 * s)
    assert half.activations < padded.activations and half.logits < padded.logits
    assert half.training_peak < padded.training_peak
    assert (half.state, half.kv_cache) == (padded.state, padded.kv_cache)
    assert abs(2 * half.activations - padded.activations) <= 2  # int() of each
    one = mem(max_tokens_per_microbatch=s)
    assert abs(2 * one.activations - half.activations) <= 2
    # Below s: the linear terms halve, the attention term quarters.
    quarter, eighth = mem(max_tokens_per_microbatch=s // 4), mem(max_tokens_per_microbatch=s // 8)

    def attn(p):  # recompute none minus selective: the attention-score term alone
        budget = p.microbatch_tokens
        return p.activations - mem("selective", max_tokens_per_microbatch=budget).activations

    assert abs(4 * attn(eighth) - attn(quarter)) <= 4
    assert 2 * eighth.activations < quarter.activations


def test_packed_attention_term_bounds_every_packing():
    """The attention scores of a packed row cost 5 a bytes per query-key pair of each sequence
    with itself: sum_i len_i^2 <= T * min(s, T), the planned term (recompute none minus selective
    leaves it alone). Checked against the trainer's own packer on random lengths, and reached by
    T / s sequences of s tokens."""
    import random

    from gspo_megatron.layout import pack_into_microbatches

    m = model_config_from_preset("qwen3-30b-a3b")
    layout, s = Layout(tp=2, ep=8), 4096
    per_pair = 5 * m.num_attention_heads * m.num_layers / (layout.tp * layout.cp)

    def attn_term(budget):
        kw = dict(seq_length=s, max_tokens_per_microbatch=budget)
        return (plan_memory(m, layout, 16, recompute=None, **kw).activations
                - plan_memory(m, layout, 16, recompute="selective", **kw).activations)

    rng = random.Random(0)
    for budget in (s // 2, s, 3 * s, 16384):
        term = attn_term(budget)
        assert abs(term - per_pair * budget * min(s, budget)) <= 1
        lengths = [rng.randint(1, min(s, budget)) for _ in range(64)]
        for mb in pack_into_microbatches(lengths, budget):
            assert sum(lengths[i] for i in mb) <= budget
            assert per_pair * sum(lengths[i] ** 2 for i in mb) <= term + 1
    # Tight: three sequences of s tokens fill a budget of 3 s.
    assert pack_into_microbatches([s, s, s], 3 * s) == [[0, 1, 2]]
    assert abs(per_pair * 3 * s * s - attn_term(3 * s)) <= 1


def test_cli_max_tokens_per_microbatch(plan):
    """--max-tokens-per-microbatch plans packed rows (the microbatch row says which); a budget of
    s * b prints the padded numbers; the recipe's trainer.max_tokens_per_microbatch is read in
    --config mode, where the flag is refused with that override."""
    base = ["--model", "qwen3-30b-a3b", "--gpus", "16", "--tp", "2", "--ep", "8", "--seq-length", "5120"]
    padded = plan(*base, "--micro-batch-size", "2")
    packed = plan(*base, "--max-tokens-per-microbatch", "10240")
    assert padded.returncode == packed.returncode == 0, packed.stderr
    assert "microbatch                       2 x 5,120 tokens, padded" in padded.stdout
    row = "microbatch                       10,240 tokens, packed (sequences <= 5,120)"
    assert row in packed.stdout
    strip = lambda text: [ln for ln in text.splitlines() if "microbatch " not in ln]  # noqa: E731
    assert strip(padded.stdout) == strip(packed.stdout)
    big = plan(*base, "--max-tokens-per-microbatch", "16384")
    m = model_config_from_preset("qwen3-30b-a3b")
    want = plan_memory(m, Layout(tp=2, ep=8), 16, seq_length=5120, max_tokens_per_microbatch=16384)
    assert big.returncode == 0 and f"{want.activations / GIB:8.2f} GiB" in big.stdout
    assert want.activations > plan_memory(m, Layout(tp=2, ep=8), 16, seq_length=5120,
                                          micro_batch_size=2).activations
    recipe = os.path.join(RECIPES, "qwen3_30b_a3b_gspo.yaml")
    r = plan("--gpus", "16", "--config", recipe, "--trainer.max_tokens_per_microbatch=16384")
    assert r.returncode == 0, r.stderr
    assert "microbatch                       16,384 tokens, packed (sequences <= 5,120)" in r.stdout
    # The recipe: TP4 EP8 ETP1, full recompute, model.seq_length 5120.
    want = plan_memory(m, Layout(tp=4, ep=8, etp=1), 16, seq_length=5120, recompute="full",
                       max_tokens_per_microbatch=16384)
    assert f"activations (estimate)           {want.activations / GIB:8.2f} GiB" in r.stdout
    assert f"log-prob logits                  {want.logits / GIB:8.2f} GiB" in r.stdout
    assert "10,240 tokens, packed (sequences <= 5,120)" in plan("--gpus", "16", "--config", recipe).stdout
    refused = plan("--gpus", "16", "--config", recipe, "--max-tokens-per-microbatch", "16384")
    assert refused.returncode != 0
    assert "--max-tokens-per-microbatch (override: --trainer.max_tokens_per_microbatch=N)" in refused.stderr


@pytest.mark.parametrize("value", ["0", "-4096"])
def test_cli_refuses_a_bad_token_budget(plan, value):
    """0 or negative: one line naming the flag, exit 2, nothing planned (the recipe's field is
    refused by the config loader the same way; plan_memory raises)."""
    p = plan("--model", "tiny", "--gpus", "1", "--max-tokens-per-microbatch", value)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == (f"plan: --max-tokens-per-microbatch must be a positive number of tokens, "
                        f"got {value}\n")
    r = plan("--gpus", "1", "--config", os.path.join(RECIPES, "tiny_gspo.yaml"),
             f"--trainer.max_tokens_per_microbatch={value}")
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1
    assert "trainer.max_tokens_per_microbatch: must be >= 1" in r.stderr
    with pytest.raises(ValueError, match="max_tokens_per_microbatch must be at least 1"):
        plan_memory(model_config_from_preset("tiny"), Layout(), 1, max_tokens_per_microbatch=int(value))


def test_longest_response_is_where_each_peak_meets_the_memory():
    """--max-response: the training limit is the longest response whose training peak fits (one
    more token does not), the rollout limit likewise for the KV cache of the engine's requests;
    a packed budget below one sequence grows to hold it."""
    from gspo_megatron.planner import longest_response, plan_for_response

    m = model_config_from_preset("qwen3-30b-a3b")
    layout, memory = Layout(tp=4, ep=8, etp=1), 80 * GIB
    kw = dict(max_tokens_per_microbatch=17408, rollout_requests=64, recompute="full")
    limit = longest_response(m, layout, 16, memory, 1024, **kw)
    assert 1024 < limit.rollout < limit.training < 1 << 20 and limit.both == limit.rollout
    at = lambda r: plan_for_response(m, layout, 16, r, 1024, **kw)  # noqa: E731
    assert at(limit.training).training_peak <= memory < at(limit.training + 1).training_peak
    assert at(limit.rollout).rollout_peak <= memory < at(limit.rollout + 1).rollout_peak
    assert at(limit.training).max_tokens_per_microbatch == 1024 + limit.training  # grew
    assert limit.training_plan.training_peak == at(limit.training).training_peak
    # a layout where nothing fits
    none = longest_response(m, Layout(), 1, memory, 1024, **kw)
    assert none.both == 0 and none.training_plan is None


def test_cli_max_response_and_response_table(plan):
    recipe = os.path.join(RECIPES, "qwen3_30b_a3b_gspo_16k.yaml")
    r = plan("--gpus", "16", "--config", recipe, "--max-response", "--responses", "8192,16384,32768")
    assert r.returncode == 0, r.stderr
    assert "prompts of 1,024 tokens" in r.stdout  # the recipe's data.max_prompt_length
    lines = [x for x in r.stdout.splitlines() if x.strip().startswith("response ")]
    assert [x.split(":")[-1].strip() for x in lines] == ["fits", "fits", "does not fit"]
    assert "longest response, both" in r.stdout
    tight = plan("--gpus", "16", "--config", recipe, "--max-response", "--gpu-memory", "20")
    assert tight.returncode == 3 and "nothing fits" in tight.stdout
    for bad in (["--responses", "8k"], ["--responses", "0"], ["--prompt-length", "0"]):
        p = plan("--gpus", "16", "--config", recipe, "--max-response", *bad)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_rollout_ranks_of_a_separate_placement(plan):
    """``rollout.placement: separate``: the trainer is planned on the GPUs left after the rollout
    ranks, one rollout rank per trainer DP rank, each a frozen full replica (bf16 weights, no
    gradient or optimizer state) plus its KV cache on one GPU."""
    recipe = os.path.join(RECIPES, "qwen3_30b_a3b_gspo.yaml")
    model = model_config_from_preset("qwen3-30b-a3b")
    # (the recipe's TP4 on one node; TP2 gives DP8 on the 16 trainer GPUs)
    separate = ["--rollout.placement=separate", "--rollout.ranks=8",
                "--parallel.tensor_model_parallel_size=2"]
    r = plan("--config", recipe, "--gpus", "24", *separate, "--rollout.max_batch_size=32")
    assert r.returncode == 0, r.stderr
    assert "16 trainer GPUs (below) + 8 rollout GPUs" in r.stdout
    assert "TP2 PP1 EP8 ETP1 CP1 DP8 on 16 GPUs" in r.stdout
    weights = count_parameters(model).total * 2
    replica = r.stdout.split("rollout rank (x8")[1]
    assert f"{'weights':32s} {weights / GIB:8.2f} GiB" in replica  # 56.87
    kv = float(replica.split("rollout KV cache (paged)")[1].split()[0]) * GIB
    # 32 requests x 5,120 tokens x 48 layers x K and V of 4 groups x 128 in bf16, in paged blocks
    assert 1 <= kv / (32 * 5120 * 48 * 4 * 128 * 2 * 2) < 1.01
    assert f"{'rollout peak':32s} {(weights + kv) / GIB:8.2f} GiB" in replica
    # 64 requests of 5,120 tokens do not fit beside 57 GiB of weights on 80 GiB
    r = plan("--config", recipe, "--gpus", "24", *separate, "--rollout.max_batch_size=64")
    assert r.returncode == 3 and "a rollout rank does not fit: 86.9 GiB > 80.0 GiB" in r.stderr
    # rollout ranks != the trainer's DP, and no GPU left to train
    r = plan("--config", recipe, "--gpus", "20", "--rollout.placement=separate",
             "--rollout.ranks=4", "--parallel.tensor_model_parallel_size=2")
    assert r.returncode == 2
    # (the trainer's own check, the same words as gspo-train's)
    assert "rollout.ranks=4 must equal the trainer's data-parallel size (8: 16 training" in r.stderr
    r = plan("--config", recipe, "--gpus", "8", *separate)
    assert r.returncode == 2 and "leaves no GPU to train on (--gpus 8)" in r.stderr


def test_held_kv_cache_counts_in_the_training_peak(plan):
    """``rollout.partial_keep_kv``: the engine holds carried requests' KV cache through training,
    so the training peak carries it too; the report says so."""
    model = model_config_from_preset("tiny", seq_length=4096)
    base = plan_memory(model, Layout(), 1, rollout_requests=64)
    held = plan_memory(model, Layout(), 1, rollout_requests=64, keep_kv=True)
    assert base.kv_cache > 0 and held.rollout_peak == base.rollout_peak
    assert held.training_peak == base.training_peak + base.kv_cache
    tiny = os.path.join(RECIPES, "tiny_gspo.yaml")
    p = plan("--gpus", "1", "--config", tiny, "--rollout.partial_rollouts=true",
             "--rollout.partial_keep_kv=true")
    assert p.returncode == 0 and "held in training" in p.stderr + p.stdout
    p = plan("--gpus", "1", "--config", tiny, "--rollout.partial_rollouts=true")
    assert p.returncode == 0 and "held in training" not in p.stderr + p.stdout


@pytest.mark.parametrize("recipe,gpus,ranks,shard", [("qwen3_30b_a3b_gspo.yaml", 20, 4, 7.49),
                                                     ("qwen3_235b_a22b_gspo.yaml", 160, 32, 10.40)])
def test_weight_transfer_host_memory_of_the_qwen3_recipes(plan, recipe, gpus, ranks, shard):
    """``rollout.placement: separate``: the busiest trainer rank keeps its main-replica shard
    (the trainer table's weights) for each of ``max_staleness + 1`` pending versions, a rollout
    rank one bucket; printed before the replica's verdict (both replicas exceed 80 GiB)."""
    r = plan("--config", os.path.join(RECIPES, recipe), "--gpus", str(gpus),
             "--rollout.placement=separate", f"--rollout.ranks={ranks}")
    assert r.returncode == 3, r.stderr
    moved = r.stdout.split("weight transfer, host memory per rank")[1]
    assert moved.startswith(" (rollout.max_staleness 1: up to 2 versions pending; buckets of "
                            "512 MiB)")
    trainer_table = r.stdout.split("rollout rank (x")[0]
    assert f"{'weights':32s} {shard:8.2f} GiB" in trainer_table  # the busiest rank's shard
    busiest = moved.split("trainer rank (busiest)")[1]
    assert abs(float(busiest.split()[0]) - 2 * shard) <= 0.01  # (both rounded to 0.01)
    assert f"(2 x its main-replica shard, {shard:.2f} GiB; pinned on CUDA)" in busiest
    assert f"{'rollout rank':32s} {0.5:8.2f} GiB (one bucket, at most)" in moved
    r = plan("--config", os.path.join(RECIPES, recipe), "--gpus", str(gpus),
             "--rollout.placement=separate", f"--rollout.ranks={ranks}",
             "--rollout.max_staleness=3", "--rollout.weight_bucket_mb=64")
    moved = r.stdout.split("weight transfer, host memory per rank")[1]
    assert "up to 4 versions pending; buckets of 64 MiB" in moved
    assert f"{'rollout rank':32s} {1 / 16:8.2f} GiB" in moved


@pytest.mark.slow  # builds a Megatron model
@pytest.mark.parametrize("bf16", [False, True])
def test_weight_transfer_shard_is_a_direct_count_of_the_pieces(bf16):
    """The planner's shard (:func:`plan_weight_transfer`) against the bytes of the main-replica
    pieces a built tiny model's trainer rank sends (one rank: all of them), and what the sender
    allocates: a snapshot of its buckets (the shard plus at most 15 bytes of alignment a box) per
    pending version, buckets of at most the bound (the rollout rank's buffer)."""
    from gspo_megatron.backends.megatron.model import build_gpt_model
    from gspo_megatron.backends.megatron.parallel import destroy_distributed, initialize_distributed
    from gspo_megatron.backends.megatron.weight_transfer import ShardIndex
    from gspo_megatron.config.model import ParallelConfig, PrecisionConfig
    from gspo_megatron.planner import plan_weight_transfer
    from gspo_megatron.weight_pieces import pack

    model = model_config_from_preset("tiny", num_layers=3, moe_layer_freq=[1, 0, 1])
    initialize_distributed(ParallelConfig(), model, seed=5)
    try:
        gpt = build_gpt_model(model, ParallelConfig(), PrecisionConfig(bf16=bf16),
                              pre_process=True, post_process=True)
        if bf16:
            gpt = gpt.to(torch.bfloat16)  # what Megatron's Float16Module holds under bf16
        pieces = ShardIndex(gpt).pieces(main_only=True)
    finally:
        destroy_distributed()
    direct = sum(p.tensor.numel() * p.tensor.element_size() for p in pieces)
    moved = plan_weight_transfer(plan_memory(model, Layout(), 1, bf16=bf16), max_staleness=1,
                                 bucket_bytes=64 << 10)
    assert moved.shard == direct and moved.trainer == 2 * direct
    layout = pack([p.box for p in pieces], moved.bucket)
    boxes = sum(len(b) for b in layout.buckets)
    assert direct <= layout.total < direct + 16 * boxes and layout.largest <= moved.rollout


def test_decode_peak_of_the_qwen3_30b_recipe(plan):
    """gspo-plan lists the fast decoder's memory per phase for the Qwen3-30B-A3B recipe: the
    experts stacked for the call (this rank's 16 of 128, 48 MoE layers, bf16), no replica (47 GiB
    would not fit a quarter of what is free), the step's logits and activations; 0 in training."""
    from gspo_megatron.decode_plan import decode_peak

    m = model_config_from_preset("qwen3-30b-a3b")
    peak = decode_peak(m, tp=2, ep=8, etp=1, pp=1, max_batch_size=64, seq_length=m.seq_length,
                       replicated=False, cuda_graphs=False)
    assert peak.stacked_experts == 48 * 16 * 3 * 2048 * 768 * 2
    assert peak.replicated_experts == 0
    assert peak.logits == 3 * 64 * m.vocab_size * 4
    assert decode_peak(m, tp=2, ep=8, etp=1, pp=1, max_batch_size=64, seq_length=m.seq_length,
                       replicated=True, cuda_graphs=False).replicated_experts == \
        7 * peak.stacked_experts
    assert decode_peak(m, tp=2, ep=8, etp=1, pp=1, max_batch_size=64, seq_length=m.seq_length,
                       replicated=False, cuda_graphs=False,
                       grouped_experts=True).stacked_experts == 0
    r = plan("--config", os.path.join(RECIPES, "qwen3_30b_a3b_gspo.yaml"), "--gpus", "16")
    assert r.returncode == 0, r.stderr
    lines = {line[:34].strip(): line[34:].strip() for line in r.stdout.splitlines()}
    assert lines["decode: stacked experts"] == f"{peak.stacked_experts / GIB:.2f} GiB"
    assert lines["decode: replicated experts"] == "0.00 GiB"
    assert lines["decode peak, training"] == "0.00 GiB"
    assert "decode peak, rollout" in lines and "rollout peak with the decoder" in lines
