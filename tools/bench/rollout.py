"""Benchmark 3: rollout tokens/s, our engine (Megatron's dynamic engine) vs Hugging Face ``generate``,
with Megatron's static batch engine (the rollout engine before the dynamic one) beside them.

    python -m tools.bench.rollout [--rounds 3] [--batch 16,128] [--new-tokens 64]

Weights: a random ``Qwen3MoeForCausalLM`` (transformers, fp32; the SMALL benchmark shape:
4 layers, one dense, 8 experts top-2, hidden 256, vocabulary 4096) converted in memory with
:func:`gspo_megatron.hf.weights.mcore_state_dict_from_hf` into the Megatron policy.
Batch: the same ``batch`` prompts of ``prompt_len`` random tokens for both, at each batch size
(default 16, latency-bound, and 128, the tiny recipes' rollout batch); greedy decoding,
``new_tokens`` per prompt. HF: ``generate(use_cache=True, do_sample=False, min_new_tokens =
max_new_tokens)`` (EOS cannot stop it). Ours: :class:`RolloutEngine` with ``top_k=1`` and an EOS
id that greedy decoding never produces on this batch (checked: every response has full length).
Both alternate in one process; tokens/s = batch x new_tokens / wall time of one call.
Where the time goes: ``cProfile`` of one call of ours (top functions by own time).
"""

from __future__ import annotations

TARGET = 1.0


def hf_model(smoke: bool, seed: int = 0):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tools.bench._model import SMALL, TOY

    s = TOY if smoke else SMALL
    conf = Qwen3MoeConfig(
        vocab_size=s["vocab_size"], hidden_size=s["hidden_size"],
        intermediate_size=s["ffn_hidden_size"], num_hidden_layers=s["num_layers"],
        num_attention_heads=s["num_attention_heads"], num_key_value_heads=s["num_query_groups"],
        head_dim=s["kv_channels"], moe_intermediate_size=s["moe_ffn_hidden_size"],
        num_experts=s["num_moe_experts"], num_experts_per_tok=s["moe_router_topk"],
        mlp_only_layers=[i for i, m in enumerate(s["moe_layer_freq"]) if not m],
        norm_topk_prob=True, max_position_embeddings=s["seq_length"], rms_norm_eps=1e-6,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(conf).float().eval()
    with torch.no_grad():  # larger than the default init so logits are not all ties
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif n.endswith("gate.weight"):
                p.normal_(0, 0.5)
            elif "embed" in n or "lm_head" in n:
                p.normal_(0, 0.5)
    return model


BREAKDOWN = (  # label, file suffix, function: cumulative time of one generate call
    ("model forward (GPTModel.forward)", "models/gpt/gpt_model.py", "forward"),
    ("self-attention (Attention.forward)", "transformer/attention.py", "forward"),
    ("MoE layer (router + dispatch + experts)", "moe/moe_layer.py", "forward"),
    ("MoE experts (SequentialMLP: one GEMM pair per expert)", "moe/experts.py", "forward"),
    ("HF MoE experts (torch._grouped_mm)", "integrations/moe.py", "grouped_mm_experts_forward"),
    ("GEMM kernels (torch.matmul / linear / _grouped_mm)", "~", "matmul|linear|_grouped_mm"),
)


def _breakdown(stats) -> dict[str, float]:
    out: dict[str, float] = {}
    for label, suffix, func in BREAKDOWN:
        tot = 0.0
        for (file, _line, name), (_cc, _nc, tt, ct, _) in stats.stats.items():
            if suffix == "~":
                if file == "~" and any(f"method {f}>" in name or name.endswith(f".{f}>")
                                       for f in func.split("|")):
                    tot += tt
            elif file.endswith(suffix) and name == func:
                tot += ct
        if tot:
            out[label] = round(tot, 4)
    out["total"] = round(stats.total_tt, 4)
    return out


def _profile_top(fn, top: int = 10) -> tuple[list[dict], float, dict]:
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    st = pstats.Stats(prof)
    total = st.total_tt
    entries = []
    for (file, line, name), (cc, nc, tt, ct, _) in st.stats.items():
        short = file.split("site-packages/")[-1].split("/work/main/")[-1]
        entries.append({"function": f"{short}:{line}({name})" if line else name,
                        "calls": nc, "own_s": tt, "cum_s": ct})
    entries.sort(key=lambda e: -e["own_s"])
    return [dict(e, own_s=round(e["own_s"], 4), cum_s=round(e["cum_s"], 4),
                 own_pct=round(100 * e["own_s"] / total, 1)) for e in entries[:top]], total, \
        _breakdown(st)


def _measure(hf, cfg, groups, pols: dict, batch: int, prompt_len: int, new_tokens: int,
             rounds: int) -> dict:
    """Our engine on each policy of ``pols`` and HF on ``batch`` random prompts: times, greedy
    agreement, profiles (of ``ours`` and HF)."""
    import torch

    from gspo_megatron.config import RolloutConfig
    from gspo_megatron.backends.megatron.engine.rollout import RolloutEngine
    from tools.bench.common import interleaved

    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=gen)

    def hf_generate():
        with torch.no_grad():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, use_cache=True,
                               pad_token_id=0)

    hf_out = hf_generate()[:, prompt_len:]
    unused = sorted(set(range(cfg.vocab_size)) - set(hf_out.flatten().tolist()))
    eos = unused[-1]
    # ours: the default (dynamic) engine; static: Megatron's static batch engine on the same
    # policy; megatron_modules: the dynamic engine without our local kernels.
    kinds = {"ours": ("ours", "auto"), "static": ("ours", "static"),
             "megatron_modules": ("megatron_modules", "auto")}
    engines = {name: RolloutEngine(
        pols[pol].model, groups, eos_id=eos, pad_id=0, vocab_size=cfg.vocab_size,
        config=RolloutConfig(max_new_tokens=new_tokens, top_k=1, temperature=1.0,
                             max_batch_size=batch, engine=kind),
        max_sequence_length=prompt_len + new_tokens) for name, (pol, kind) in kinds.items()}
    prompts = ids.tolist()
    agree, lengths = {}, set()
    for name, engine in engines.items():
        out = engine.generate(prompts, seed=0)
        lengths |= {len(s.response_ids) for s in out}
        agree[name] = sum(a == b for s, h in zip(out, hf_out.tolist())
                          for a, b in zip(s.response_ids, h)) / (batch * new_tokens)
    fns = {name: (lambda e=engine: e.generate(prompts, seed=0)) for name, engine in engines.items()}
    times = interleaved({**fns, "hf": hf_generate}, rounds=rounds, warmup=1)
    top, prof_total, split = _profile_top(fns["ours"])
    hf_top, hf_total, hf_split = _profile_top(hf_generate, top=6)
    return {"times": times, "agree": agree, "eos": eos,
            "lengths": sorted(lengths),
            "profile_ours": {"total_s": round(prof_total, 4), "breakdown_s": split,
                             "top_own_time": top},
            "profile_hf": {"total_s": round(hf_total, 4), "breakdown_s": hf_split,
                           "top_own_time": hf_top}}


def run(smoke: bool = False, rounds: int = 3, batch: str = "16,128", prompt_len: int = 16,
        new_tokens: int = 64, threads: int = 1) -> dict:
    """``batch``: comma-separated batch sizes, each measured on its own. 128 is the tiny
    recipes' rollout batch (16 prompts x group size 8); 16 is latency-bound decoding."""
    import json

    import torch

    from gspo_megatron.hf.config import model_config_from_hf
    from gspo_megatron.hf.weights import mcore_state_dict_from_hf
    from tools.bench import _model
    from tools.bench.common import make_result, median, median_ratio, quiet_megatron, row

    quiet_megatron()
    torch.set_num_threads(threads)
    batches = [int(b) for b in str(batch).split(",")]
    if smoke:
        rounds, batches, prompt_len, new_tokens = 1, [2], 4, 4
    hf = hf_model(smoke)
    cfg = model_config_from_hf(json.loads(hf.config.to_json_string()),
                               seq_length=prompt_len + new_tokens)
    with _model.distributed(cfg) as groups:
        # ours: the default local spec (gspo_megatron.backends.megatron.kernels.local); megatron_modules: the
        # same weights in Megatron's own local-spec modules (precision.local_kernels=false).
        pols = {"ours": _model.policy(cfg, groups, with_optimizer=False),
                "megatron_modules": _model.policy(cfg, groups, with_optimizer=False,
                                                  local_kernels=False)}
        sd = mcore_state_dict_from_hf(hf.state_dict(), cfg)
        for pol in pols.values():
            missing, unexpected = pol.unwrapped().load_state_dict(sd, strict=False)
            missing = [k for k in missing if not k.endswith("_extra_state")]
            if missing or unexpected:
                raise RuntimeError(f"conversion: missing {missing[:5]}, "
                                   f"unexpected {unexpected[:5]}")
        per_batch = {b: _measure(hf, cfg, groups, pols, b, prompt_len, new_tokens, rounds)
                     for b in batches}
    rows, ratios, notes, config = [], {}, [], {}
    for b, m in per_batch.items():
        tokens, times = b * new_tokens, m["times"]
        ratio = 1.0 / median_ratio(times, "ours", "hf")  # tokens/s ratio = inverse time ratio
        ratios[f"ours_vs_hf_tokens_per_s_batch{b}"] = ratio
        ratios[f"static_vs_hf_tokens_per_s_batch{b}"] = 1.0 / median_ratio(times, "static", "hf")
        speedup = median_ratio(times, "megatron_modules", "ours")
        rows += [row(f"batch {b}: ours tokens/s", tokens / median(times["ours"]), "tok/s"),
                 row(f"batch {b}: static engine tokens/s", tokens / median(times["static"]),
                     "tok/s"),
                 row(f"batch {b}: ours / static engine tokens/s",
                     1.0 / median_ratio(times, "ours", "static"), "x"),
                 row(f"batch {b}: ours with Megatron's modules tokens/s",
                     tokens / median(times["megatron_modules"]), "tok/s"),
                 row(f"batch {b}: HF generate tokens/s", tokens / median(times["hf"]), "tok/s"),
                 row(f"batch {b}: local_kernels speed-up (ours / Megatron's modules)", speedup,
                     "x"),
                 row(f"batch {b}: ours / HF tokens/s", ratio, "x"),
                 row(f"batch {b}: greedy tokens equal to HF's", min(m["agree"].values()),
                     "fraction")]
        split, hf_split = m["profile_ours"]["breakdown_s"], m["profile_hf"]["breakdown_s"]
        notes += [f"batch {b}: response lengths (ours) {m['lengths']}"]
        notes += [f"batch {b}, ours (cProfile, one call): {k} {v:.3f} s "
                  f"({100 * v / split['total']:.0f}%)" for k, v in split.items() if k != "total"]
        notes += [f"batch {b}, HF (cProfile, one call): {k} {v:.3f} s "
                  f"({100 * v / hf_split['total']:.0f}%)"
                  for k, v in hf_split.items() if k != "total"]
        config[f"batch{b}"] = {k: v for k, v in m.items() if k != "times"}
        config[f"batch{b}"]["times"] = {k: [round(x, 4) for x in v] for k, v in times.items()}
    notes.insert(0, f"prompt {prompt_len} -> {new_tokens} new tokens, greedy, fp32, torch threads "
                    f"{threads}; {rounds} interleaved rounds after 1 warm-up per batch size")
    return make_result(
        "rollout", "Rollout tokens/s: RolloutEngine (Megatron dynamic engine) vs HF generate",
        f"ours / HF tokens/s >= {TARGET} at every batch size",
        all(r >= TARGET for r in ratios.values()), rows, ratios,
        config={"batches": batches, "prompt_len": prompt_len, "new_tokens": new_tokens,
                "rounds": rounds, "threads": threads, **config},
        notes=notes)


def _args(ap) -> None:
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--batch", help="comma-separated batch sizes (default 16,128)")
    ap.add_argument("--new-tokens", type=int)
    ap.add_argument("--threads", type=int)


if __name__ == "__main__":
    from tools.bench.common import module_main

    module_main(run, extra_args=_args)
