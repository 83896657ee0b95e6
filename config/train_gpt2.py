# GPT-2 (124M) on OpenWebText: nanoGPT's recipe, for one node of 8 GPUs.
#   python data/openwebtext/prepare.py
#   torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py
# nanoGPT reports val loss ~2.85 after ~4 days on 8 A100 40GB (300B tokens); the released
# GPT-2 124M scores ~3.12 on the same data (config/eval_gpt2.py), having seen different text.

out_dir = "out-gpt2"
wandb_log = False  # nanoGPT turns it on for this run; --wandb_log=True once wandb is set up
wandb_project = "owt"
wandb_run_name = "gpt2-124M"

dataset = "openwebtext"
# 12 sequences x 1024 tokens x 40 micro-steps = 491,520 tokens per optimizer step (~0.5M, the
# batch of GPT-3's small models); under torchrun the 40 micro-steps are split over the 8 ranks
batch_size = 12
block_size = 1024
gradient_accumulation_steps = 5 * 8

# the GPT-2 small shape; no biases (nanoGPT's choice: a little faster, no worse)
n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0  # pretraining on far more text than the model can memorize
bias = False

# 600k steps x 491,520 tokens = ~295B tokens
learning_rate = 6e-4
max_iters = 600000
lr_decay_iters = 600000  # the cosine reaches min_lr at the last step
min_lr = 6e-5  # learning_rate / 10, as in the Chinchilla paper
warmup_iters = 2000
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95  # a shorter second-moment memory than Adam's 0.999 steadies large-batch LM training
grad_clip = 1.0

eval_interval = 1000
eval_iters = 200
log_interval = 10
