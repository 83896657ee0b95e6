# A 1.24B-parameter dense model with Llama-3.2-1B's architecture, trained from scratch on ~20B
# FineWeb-Edu tokens with ~1M tokens per step.
#
#   python data/fineweb_edu/prepare.py --name=sample-100BT --tokens=21e9 \
#       --tokenizer=path/to/Llama-3.2-1B/tokenizer.json --out_dir=data/fineweb_edu_llama3
#   python bench.py config/train_llama_1b.py --bench_iters=3 --bench_warmup=1   # speed and MFU first
#   python train.py config/train_llama_1b.py                                      # one H100: ~5 days
#   torchrun --standalone --nproc_per_node=8 train.py config/train_llama_1b.py    # 8 GPUs, DDP
#   torchrun --standalone --nproc_per_node=8 train.py config/train_llama_1b.py --parallelism=fsdp
#
# The vocabulary comes from the data (data/<dataset>/meta.json). Llama-3.2-1B's is 128,256 tokens
# (tied, 1,235,814,400 parameters), hence the Llama 3 tokenizer above. Prepared with GPT-2's BPE
# instead (--dataset=fineweb_edu), the same shapes make a 1.07B model (50,304 rows, padded).
# ~9.0 GFLOPs per token: 20B tokens are ~5.3 days on one H100 at 40% MFU, ~16 hours on eight.

out_dir = "out-llama-1b"
dataset = "fineweb_edu_llama3"
wandb_project = "llama-1b"
wandb_run_name = "llama-1b-fineweb-edu-20b"

# Llama-3.2-1B's shapes: 16 blocks of 2048 wide, 32 query heads sharing 8 key/value heads (64 dims
# each), SwiGLU 8192 wide, RoPE with base 500000, RMSNorm, no biases, tied embeddings
n_layer = 16
n_head = 32
n_kv_head = 8
n_embd = 2048
mlp = "swiglu"
mlp_hidden = 8192
pos_encoding = "rope"
rope_theta = 500000.0
norm = "rmsnorm"
bias = False
tie_embeddings = True
dropout = 0.0  # one pass over 20B tokens: nothing to regularize

# 4 x 4096 tokens per micro-step x 64 micro-steps = 1,048,576 tokens per optimizer step (on 8 GPUs,
# 8 micro-steps each). One sequence of 4096 keeps ~12 GB of bf16 activations for backward
# (measured with train.saved_activation_bytes), and the fp32 weights, gradients and AdamW moments
# take ~20 GB, so 4 fit an 80 GB H100. Short of memory: batch_size=2 with gradient_accumulation_steps=128,
# or activation_checkpointing=True (a third more compute) with a larger batch_size.
block_size = 4096
batch_size = 4
gradient_accumulation_steps = 64

# AdamW as Llama and TinyLlama (a 1.1B Llama) trained: betas (0.9, 0.95), weight decay 0.1, clip 1.0,
# peak 4e-4 after a short warmup, cosine down to a tenth. 19,073 steps x 1,048,576 = 20.0B tokens.
learning_rate = 4e-4
min_lr = 4e-5
beta1 = 0.9
beta2 = 0.95
weight_decay = 0.1
grad_clip = 1.0
warmup_iters = 1000  # ~1B tokens
max_iters = 19073
lr_decay_iters = 19073

eval_interval = 500  # ~0.5B tokens between evaluations and checkpoints
eval_iters = 64  # x 4 x 4096 = 1M tokens per split; a multiple of 8 so FSDP over 8 ranks splits it evenly
log_interval = 10

dtype = "bfloat16"
compile = True
parallelism = "ddp"  # the 1B fits one GPU; 'fsdp' shards the ~20 GB of fp32 states over the ranks instead
