#!/usr/bin/env bash
# The four short recipes whose metrics a behaviour-preserving change must leave bitwise: the demo
# (60 SFT + 8 RL steps), the tiny recipe with R3, with partial rollouts + kept KV + R3, and with
# rollouts on a rank of their own (staleness 1, partial, kept KV; two processes).
#
#   tools/run_recipes.sh OUT_DIR            # then, for each of demo r3 partial separate:
#   python tools/compare_runs.py BEFORE/demo OUT_DIR/demo
set -euo pipefail
out=${1:?usage: tools/run_recipes.sh OUT_DIR}
python=${PYTHON:-python3}
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 WANDB_MODE=disabled PYTHONPATH=$PWD
small=(--data.num_train_examples=200 --data.num_eval_examples=20 --model.seq_length=16
       --rollout.max_new_tokens=4 --data.max_prompt_length=8 --rollout.group_size=4
       --rollout.prompts_per_step=4 --trainer.num_minibatches=2 --trainer.micro_batch_size=4
       --sft.steps=20 --sft.batch_size=32 --logging.progress=false)
tiny=(--config examples/configs/tiny_gspo.yaml "${small[@]}")
rm -rf "$out" && mkdir -p "$out"
"$python" -m gspo_megatron.cli --logging.run_dir="$out/demo" --sft.steps=60 --trainer.steps=8 \
    --trainer.eval_interval=4 --logging.progress=false > "$out/demo.log" 2>&1
"$python" -m gspo_megatron.cli "${tiny[@]}" --logging.run_dir="$out/r3" --trainer.steps=4 \
    --routing.replay=r3 > "$out/r3.log" 2>&1
"$python" -m gspo_megatron.cli "${tiny[@]}" --logging.run_dir="$out/partial" --trainer.steps=5 \
    --rollout.partial_rollouts=true --rollout.partial_keep_kv=true --routing.replay=r3 \
    --rollout.max_new_tokens=8 > "$out/partial.log" 2>&1
"$python" -m torch.distributed.run --nproc_per_node=2 --master_port="${MASTER_PORT:-29611}" \
    -m gspo_megatron.cli "${tiny[@]}" --logging.run_dir="$out/separate" --trainer.steps=5 \
    --rollout.placement=separate --rollout.ranks=1 --rollout.max_staleness=1 \
    --rollout.partial_rollouts=true --rollout.partial_keep_kv=true --rollout.max_new_tokens=8 \
    > "$out/separate.log" 2>&1
echo "wrote $out/{demo,r3,partial,separate}"
