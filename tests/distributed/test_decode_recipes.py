"""Each shipped Qwen3 recipe's rollout layout decodes through the multi-step step function
(``kernels/decode.py``: TP column / row shards, expert parallelism, the experts' own TP), and its
greedy tokens equal Megatron's forward on the same layout and Hugging Face ``generate`` on the
same weights.

The model is a shrunk Qwen3-MoE (8 heads over 4 key/value heads, 8 experts top-2, a dense first
layer), converted from a random HF checkpoint; the layouts are the recipes' tensor / expert-tensor
sizes with the expert-parallel size cut to 4 ranks (2 cores: TP2 x EP8 -> TP2 x EP4, TP4 x EP8 /
EP64 -> TP4 x EP4). Every rank holds the same prompts (DP 2 or 1), so each rank's tokens are
HF's.
"""

import json
import os

import pytest
import yaml
import torch

from tests.helpers.torchrun import torchrun

pytest.importorskip("transformers")

from tests.helpers.hf import sharpen_random_init  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "decode_recipe_worker.py")
NEW_TOKENS = 10
HF_SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=4, head_dim=8, moe_intermediate_size=16,
                num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=True,
                max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(mcore dir, prompts file, HF's greedy tokens) of one shrunk Qwen3-MoE."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from gspo_megatron.tools.convert_hf import convert_hf_to_mcore

    base = tmp_path_factory.mktemp("decode_recipes")
    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**HF_SHAPE)).float().eval()
    sharpen_random_init(hf)
    with torch.no_grad():  # sharper logits: greedy argmaxes far from ties
        hf.lm_head.weight.mul_(8.0)
    hf.save_pretrained(str(base / "hf"))
    convert_hf_to_mcore(str(base / "hf"), str(base / "mcore"))
    ids = torch.randint(1, HF_SHAPE["vocab_size"], (6, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True,
                          pad_token_id=0)[:, ids.shape[1]:]
    prompts = str(base / "prompts.json")
    with open(prompts, "w") as f:
        json.dump(ids.tolist(), f)
    return base, str(base / "mcore"), prompts, out.tolist()


# Every shipped Qwen3 recipe decodes at TP4 x EP (ETP 1): 30B (EP8, one node), its GRPO and 16k
# variants (EP8), 235B (EP64); on 4 gloo ranks each becomes TP4 x EP4, so one run covers them all.
QWEN3_RECIPES = ("qwen3_30b_a3b_gspo.yaml", "qwen3_30b_a3b_grpo.yaml",
                 "qwen3_30b_a3b_gspo_16k.yaml", "qwen3_235b_a22b_gspo.yaml")


def test_every_shipped_recipe_decodes_at_the_layout_tested():
    """The layout the run below decodes at is each shipped recipe's, shrunk to 4 ranks."""
    for name in QWEN3_RECIPES:
        with open(os.path.join(ROOT, "examples", "configs", name)) as f:
            par = yaml.safe_load(f)["parallel"]
        tp, etp = par["tensor_model_parallel_size"], par.get("expert_tensor_parallel_size")
        assert (tp, etp, min(par["expert_model_parallel_size"], 4 // (etp or tp))) == (4, 1, 4), name


@pytest.mark.parametrize("recipe, layout", [
    ("qwen3_30b_a3b_gspo.yaml", [4, 4, 1]),  # TP4 x EP8, ETP1 -> TP4 x EP4
])
def test_recipe_layout_decodes_through_the_step_function(checkpoint, recipe, layout):
    base, mcore, prompts, hf_tokens = checkpoint
    out = str(base / recipe)
    torchrun(4, WORKER, "--recipe", os.path.join(ROOT, "examples", "configs", recipe),
             "--mcore", mcore, "--prompts", prompts, "--new-tokens", str(NEW_TOKENS),
             "--out", out, timeout=400)
    for rank in range(4):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            got = json.load(f)
        assert got["layout"] == layout
        assert got["fast_16"] and not got["fast_0"], (recipe, rank)
        assert got["tokens_16"] == got["tokens_0"], (recipe, rank)  # = Megatron's forward
        assert got["tokens_16"] == hf_tokens, (recipe, rank)  # = Hugging Face generate
