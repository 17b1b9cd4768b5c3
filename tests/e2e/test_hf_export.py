"""HF -> gspo-convert-hf -> gspo-train -> gspo-export-hf -> transformers, end to end (CPU).

A tiny random bf16 ``Qwen3MoeForCausalLM`` (a shape no other test uses) in several shards, with a
tokenizer, is converted, trained for a few real steps starting from the converted weights, and the
training checkpoint (model + optimizer + scheduler + extra) is exported. The export must load with
``AutoModelForCausalLM`` / ``AutoTokenizer``, keep bf16, hold the trained weights (changed from the
source, equal to the checkpoint's rounded to bf16) and give the trained Megatron model's logits.
"""

import json
import os
import subprocess

import pytest
import torch

from tests.helpers import warm
from tests.helpers.hf import sharpen_random_init

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
yaml = pytest.importorskip("yaml")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(ROOT, "examples", "configs", "tiny_gspo.yaml")

# 3 layers, 6 experts top-2, hidden 48, 4 heads / 2 KV groups, head_dim 12 != 48/4, vocab 128
HF_KWARGS = dict(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                 moe_intermediate_size=20, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
                 max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", WANDB_MODE="disabled", CUDA_VISIBLE_DEVICES="")
    return env


def _run(args, timeout=300) -> subprocess.CompletedProcess:
    """Run ``python -m <args>`` forked from the warm interpreter (:mod:`tests.helpers.warm`), in
    its own process group, killed afterwards (the checkpoint writer can leave helper processes)."""
    return warm.run(["-m", *args], env=_env(), cwd=ROOT, timeout=timeout)


def make_hf_dir(directory):
    """Random bf16 model in several shards + a WordLevel fast tokenizer + generation_config."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(7)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**HF_KWARGS)).eval()
    sharpen_random_init(model)
    model = model.to(torch.bfloat16)
    model.save_pretrained(directory, max_shard_size="60KB")
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, 128)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(directory)
    return model


def read_safetensors(directory):
    from safetensors import safe_open

    out = {}
    for file in sorted(f for f in os.listdir(directory) if f.endswith(".safetensors")):
        with safe_open(os.path.join(directory, file), framework="pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def megatron_model(weights_dir, cfg):
    """A TP=1 fp32 Megatron model holding the weights of ``weights_dir`` (any checkpoint kind)."""
    from gspo_megatron.backends.megatron.checkpoint import load_model_weights
    from gspo_megatron.backends.megatron.model import build_gpt_model
    from gspo_megatron.config.model import ParallelConfig, PrecisionConfig

    gpt = build_gpt_model(cfg, ParallelConfig(), PrecisionConfig(transformer_impl="local"),
                          pre_process=True, post_process=True)
    load_model_weights(gpt, weights_dir)
    return gpt.eval()


def test_convert_train_export_loads_in_transformers(tmp_path):
    from gspo_megatron.hf.weights import hf_state_dict_from_mcore
    from gspo_megatron.backends.megatron.parallel import destroy_distributed, initialize_distributed
    from gspo_megatron.config.model import ParallelConfig
    from gspo_megatron.tools.export_hf import read_mcore_configs

    hf_dir, mcore = tmp_path / "hf", tmp_path / "mcore"
    make_hf_dir(str(hf_dir))
    assert len([f for f in os.listdir(hf_dir) if f.endswith(".safetensors")]) > 2
    source = read_safetensors(str(hf_dir))
    assert all(t.dtype == torch.bfloat16 for t in source.values())

    proc = _run(["gspo_megatron.tools.convert_hf", "--hf-dir", str(hf_dir), "--out", str(mcore)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((mcore / "model_config.json").read_text())
    assert json.loads((mcore / "hf_source.json").read_text())["dtype"] == "bfloat16"

    # A real short training run starting from the converted weights. The recipe names no model
    # field but the sequence length: the architecture comes from the converted model_config.json.
    recipe = yaml.safe_load(open(RECIPE))
    recipe["model"] = {"seq_length": 16}
    recipe["checkpoint"] = dict(recipe.get("checkpoint") or {}, init_weights=str(mcore),
                                save_interval=0)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    run = tmp_path / "run"
    proc = _run(["gspo_megatron.cli", "--config", str(tmp_path / "recipe.yaml"),
                 f"--logging.run_dir={run}", "--logging.progress=false",
                 "--data.num_train_examples=64", "--data.num_eval_examples=4",
                 "--rollout.max_new_tokens=4", "--data.max_prompt_length=8",
                 "--rollout.group_size=4", "--rollout.prompts_per_step=4",
                 "--trainer.num_minibatches=2", "--trainer.micro_batch_size=4",
                 "--sft.steps=3", "--sft.batch_size=8", "--trainer.steps=3",
                 "--trainer.eval_interval=0", f"--checkpoint.export_hf={tmp_path / 'final'}"],
               timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    saved = yaml.safe_load(open(run / "config.yaml"))["model"]
    assert {k: saved[k] for k in ("num_layers", "num_moe_experts", "hidden_size")} == \
        {k: meta[k] for k in ("num_layers", "num_moe_experts", "hidden_size")}
    ckpt = run / "checkpoints" / "iter_0000003"
    assert ckpt.is_dir() and (run / "sft_weights").is_dir()

    # Export the training checkpoint (optimizer, scheduler, step, extra inside).
    out = tmp_path / "export"
    proc = _run(["gspo_megatron.tools.export_hf", "--mcore-dir", str(ckpt), "--out", str(out),
                 "--max-shard-size", "80KB"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    carried = [n for n in os.listdir(hf_dir) if n.endswith(".json") and "safetensors" not in n
               and n != "config.json"]
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(carried)
    for name in ("config.json", *carried):
        assert (out / name).is_file(), name
    assert (out / "model.safetensors.index.json").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["num_experts"] == 6
    # The checkpoints dir (latest iteration) and sft_weights export too.
    for src, dst in ((run / "checkpoints", "export_latest"), (run / "sft_weights", "export_sft")):
        proc = _run(["gspo_megatron.tools.export_hf", "--mcore-dir", str(src),
                     "--out", str(tmp_path / dst)])
        assert proc.returncode == 0, proc.stderr[-3000:]
    exported = read_safetensors(str(out))
    # gspo-train's own export of the final policy (checkpoint.export_hf) is the same model
    final = read_safetensors(str(tmp_path / "final"))
    assert final.keys() == exported.keys()
    assert all(torch.equal(final[k], v) for k, v in exported.items())
    assert (tmp_path / "final" / "tokenizer.json").is_file()
    assert exported.keys() == source.keys()
    assert all(t.dtype == torch.bfloat16 for t in exported.values())
    assert all(torch.equal(exported[k], v) for k, v in read_safetensors(str(tmp_path / "export_latest")).items())
    assert not all(torch.equal(exported[k], v)
                   for k, v in read_safetensors(str(tmp_path / "export_sft")).items())
    changed = [k for k in source if not torch.equal(exported[k], source[k])]
    print(f"\n{len(changed)}/{len(source)} tensors changed by training")
    assert len(changed) > len(source) // 2

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert hf.dtype == torch.bfloat16
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.convert_tokens_to_ids("t5") == 5 and tok.eos_token == "<eos>"

    # The trained Megatron model, loaded from the training checkpoint in this process.
    cfg, _, _ = read_mcore_configs(str(mcore))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    initialize_distributed(ParallelConfig(), cfg, seed=0)
    try:
        gpt = megatron_model(str(ckpt), cfg)
        state = {k: v.detach() for k, v in gpt.state_dict().items() if torch.is_tensor(v)}
        assert next(iter(state.values())).dtype == torch.float32  # trained in fp32 on CPU
        # exported weights = the checkpoint's model weights rounded to bf16, bitwise
        expect = hf_state_dict_from_mcore(state, cfg)
        for k, v in expect.items():
            assert torch.equal(exported[k], v.to(torch.bfloat16)), k
        with torch.no_grad():
            pos = torch.arange(ids.shape[1]).expand_as(ids)
            ref = gpt(ids, pos, attention_mask=None)[..., :128]  # fp32 trained weights
            for p in gpt.parameters():  # the same weights rounded to bf16, computed in fp32
                p.copy_(p.to(torch.bfloat16).float())
            ref_bf16w = gpt(ids, pos, attention_mask=None)[..., :128]
    finally:
        destroy_distributed()
    with torch.no_grad():
        hf32 = hf.float()
        got = hf32(ids, output_router_logits=False).logits
    exact = (got - ref_bf16w).abs().max().item()
    vs_fp32 = (got - ref).abs().max().item()
    print(f"max |logit diff|: exported (fp32 compute) vs Megatron with bf16-rounded weights "
          f"{exact:.3g}; vs Megatron fp32 trained weights {vs_fp32:.3g} "
          f"(logit scale {ref.abs().max().item():.3g})")
    assert exact < 2e-6  # measured 1.5e-7 (docs/hf_conversion.md): fp32 kernels, summation order
    assert vs_fp32 < 0.1 * max(1.0, ref.abs().max().item())
