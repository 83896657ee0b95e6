# GPT-2 (124M) on FineWeb-Edu with one GPU: ~10B tokens, the size of FineWeb-Edu's
# sample-10BT, which is enough for a 124M model to pass the released GPT-2 124M on HellaSwag
# (as Karpathy's llm.c and build-nanogpt runs showed with this batch and token count).
#   python data/fineweb_edu/prepare.py
#   python train.py config/train_gpt2_fineweb_edu.py
#   python bench.py config/train_gpt2_fineweb_edu.py --estimate_tokens=10e9   # hours on this GPU

out_dir = "out-gpt2-fineweb-edu"
wandb_log = False
wandb_project = "fineweb-edu"
wandb_run_name = "gpt2-124M"

dataset = "fineweb_edu"
# 8 sequences x 1024 tokens x 64 micro-steps = 524,288 tokens (2**19) per optimizer step: the
# ~0.5M-token batch of the 8-GPU recipe, reached by accumulation instead of GPUs. Memory
# decides the split, not the result: --batch_size=auto --total_batch_size=524288 picks the
# largest micro-batch that fits this GPU and keeps the tokens per step
batch_size = 8
gradient_accumulation_steps = 64
block_size = 1024

n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = False

# 19,073 steps x 524,288 tokens = 10.0B tokens: one pass over sample-10BT (no repeated data)
max_iters = 19073
lr_decay_iters = 19073
# 715 steps (375M tokens) of warmup, as in build-nanogpt; 3e-4, half of nanoGPT's 6e-4, is
# a conservative peak for a long unattended run on one GPU
warmup_iters = 715
learning_rate = 3e-4
min_lr = 3e-5  # learning_rate / 10
weight_decay = 1e-1
beta2 = 0.95

eval_interval = 250  # ~131M tokens between evals: about 76 points on the curve
eval_iters = 100  # 100 x 8 x 1024 = 0.8M tokens per split: a stable estimate, a few seconds each
log_interval = 10
compile = True  # one long run on one GPU: the compile time is paid back many times
