"""Converted HF Qwen3-MoE checkpoints give HF's logits under TP=2 (sequence parallel) and EP=2, and the
converter itself runs under torchrun (EP=2, PP=2), on gloo (2 processes).

Two tiny random configs (GQA 2 with head_dim != hidden/heads and a dense layer via mlp_only_layers;
GQA 4 with decoder_sparse_step=2 and norm_topk_prob=False, several shards). Each is converted once in
one process (loaded at TP=2) and once under torchrun with EP=2 or PP=2 (loaded at EP=2), so both
loading layouts differ from the one that wrote the checkpoint (except EP=2 -> EP=2).
"""

import os

import pytest
import torch

from tests.helpers.torchrun import torchrun

pytest.importorskip("transformers")

from tests.helpers.hf import HF_LOGIT_TOL  # noqa: E402
from tests.unit.test_hf_conversion import hf_logits, input_ids, save_hf_model  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "hf_parity_worker.py")
# name -> how the torchrun conversion splits the work
CASES = {"gqa2_hd12_mlponly": "ep=2", "gqa4_hd8_sparsestep2": "pp=2"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from gspo_megatron.tools.convert_hf import convert_hf_to_mcore

    base = tmp_path_factory.mktemp("hf_parity")
    out = {}
    for name, split in CASES.items():
        hf_dir = str(base / f"{name}_hf")
        model = save_hf_model(name, hf_dir)
        single, multi = str(base / f"{name}_mcore"), str(base / f"{name}_mcore_torchrun")
        convert_hf_to_mcore(hf_dir, single)
        ids = input_ids(model.config.vocab_size, seed=3)
        ids_path = str(base / f"{name}_ids.pt")
        torch.save(ids, ids_path)
        ep, pp = (2, 1) if split == "ep=2" else (1, 2)
        out[name] = dict(single=single, multi=multi, ids=ids_path, ref=hf_logits(model, ids),
                         vocab=model.config.vocab_size, convert=f"{hf_dir}:{multi}:{ep}:{pp}")
    return base, out


@pytest.mark.parametrize("layout, args, ckpt", [
    ("tp2_sp", ["--tp", "2"], "single"),
    ("ep2", ["--ep", "2"], "multi"),
])
def test_megatron_logits_match_hf_under_layout(checkpoints, layout, args, ckpt):
    base, cases = checkpoints
    specs = []
    for name, c in cases.items():
        out = str(base / f"{name}_{layout}_logits.pt")
        if ckpt == "multi":  # converted by the same torchrun job, first
            specs += ["--convert", c["convert"]]
        specs += ["--case", f"{c[ckpt]}:{c['ids']}:{out}"]
    torchrun(2, WORKER, *args, *specs)
    for name, c in cases.items():
        logits = torch.load(str(base / f"{name}_{layout}_logits.pt"))
        assert logits.shape[:2] == c["ref"].shape[:2] and logits.shape[-1] % 128 == 0
        diff = (logits[..., :c["vocab"]] - c["ref"]).abs().max().item()
        print(f"{name} {layout} (checkpoint written by {'torchrun ' + CASES[name] if ckpt == 'multi' else 'one process'}): "
              f"max |logit diff| = {diff:.3g}")
        assert diff < HF_LOGIT_TOL, (name, layout, diff)
        assert not logits[..., c["vocab"]:].any()
