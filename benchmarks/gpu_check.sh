#!/usr/bin/env bash
# One short GPU check of the real `lit_moe fit` path (CUDA + NCCL process group, bf16 compute with fp32
# master weights): the tiny config on the shipped corpus, then a larger DeepSeek-V3-shaped model on mock
# data for throughput/MFU. Prints everything; run from the repository root on a CUDA machine.
set -u
OUT=${OUT:-/tmp/lit_moe_gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, 'cuda', torch.cuda.is_available())"
echo "== tiny config, 20 steps, cuda"
timeout 120 python3 -m lit_moe.cli fit --config configs/tiny.yaml --trainer.accelerator cuda --trainer.devices 1 \
  --training.steps 20 --checkpoint.enable_save False --monitor.tensorboard.output_dir "$OUT/tb_tiny" 2>&1 \
  | grep -E "^step |rror|MFU|nccl|NCCL" | tail -8
echo "== larger model (hidden 2048, 4 layers, 16 experts top-4, seq 4096), mock data, 10 steps, cuda"
timeout 150 python3 -m lit_moe.cli fit --config configs/tiny.yaml --trainer.accelerator cuda --trainer.devices 1 \
  --training.steps 10 --checkpoint.enable_save False --monitor.tensorboard.output_dir "$OUT/tb_large" \
  --model.hidden_size 2048 --model.num_attention_heads 16 --model.q_lora_rank 768 --model.kv_lora_rank 256 \
  --model.qk_nope_head_dim 64 --model.qk_rope_head_dim 32 --model.v_head_dim 64 --model.intermediate_size 5632 \
  --model.moe_intermediate_size 1024 --model.moe_shared_expert_intermediate_size 1024 --model.n_routed_experts 16 \
  --model.num_experts_per_tok 4 --model.num_hidden_layers 4 --model.seq_length 4096 --model.vocab_size 32000 \
  --model.num_nextn_predict_layers 0 --train_dataset.dataloader.config.seq_length 4096 \
  --train_dataset.dataloader.config.data_path null --training.local_batch_size 2 --training.global_batch_size 2 2>&1 \
  | grep -E "^step |rror|MFU" | tail -8
