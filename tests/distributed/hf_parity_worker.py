"""Megatron logits of converted HF checkpoints under one layout (run under torchrun by
test_hf_parity_distributed.py).

First, each ``--convert HF_DIR:OUT_DIR:EP:PP`` runs the HF -> Megatron converter on all ranks with
that split of the work (the converter under torchrun). Then for each ``--case DIR:IDS:OUT``: load the dist checkpoint DIR (its ``model_config.json`` gives the
architecture) into a GPTModel with this rank's TP/EP layout, run the token ids saved in IDS
(``torch.save`` of a [B, T] tensor) without attention mask, gather the vocab-parallel logits over
TP, and rank 0 saves the full ``[B, T, padded_vocab]`` logits to OUT.
"""

import argparse

import torch
import torch.distributed as dist

from gspo_megatron.backends.megatron.checkpoint import load_model_weights
from gspo_megatron.backends.megatron.model import build_gpt_model
from gspo_megatron.backends.megatron.parallel import destroy_distributed, initialize_distributed
from gspo_megatron.config.model import ParallelConfig, PrecisionConfig
from gspo_megatron.tools.convert_hf import convert_hf_to_mcore
from gspo_megatron.tools.export_hf import read_mcore_configs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--convert", action="append", default=[], help="HF_DIR:OUT_DIR:EP:PP")
    ap.add_argument("--case", action="append", required=True, help="MCORE_DIR:IDS_PT:OUT_PT")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    for job in args.convert:
        hf_dir, out_dir, ep, pp = job.split(":")
        convert_hf_to_mcore(hf_dir, out_dir, expert_model_parallel_size=int(ep),
                            pipeline_model_parallel_size=int(pp))
    for case in args.case:
        mcore_dir, ids_path, out_path = case.split(":")
        cfg, _, _ = read_mcore_configs(mcore_dir)
        parallel = ParallelConfig(tensor_model_parallel_size=args.tp, expert_model_parallel_size=args.ep,
                                  sequence_parallel=args.tp > 1)
        ids = torch.load(ids_path)
        cfg.seq_length = ids.shape[1]
        groups = initialize_distributed(parallel, cfg, seed=0)
        gpt = build_gpt_model(cfg, parallel, PrecisionConfig(transformer_impl="local"),
                              pre_process=True, post_process=True)
        load_model_weights(gpt, mcore_dir)
        gpt.eval()
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        with torch.no_grad():
            logits = gpt(ids, positions, attention_mask=None)  # [B, T, V/TP]
        if groups.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(groups.tp_size)]
            dist.all_gather(parts, logits.contiguous(), group=groups.tp_group)
            logits = torch.cat(parts, dim=-1)
        if groups.rank == 0:
            torch.save(logits, out_path)
        del gpt
    destroy_distributed()


if __name__ == "__main__":
    main()
