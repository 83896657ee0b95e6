# The CPU quick start: a character-level GPT that reaches val loss ~1.86 on tiny Shakespeare
# in about half a minute on 2 CPU cores (nanoGPT's own CPU recipe needs 2000 steps of a 4-layer
# model for ~1.89). `make quickstart` runs it:  python train.py config/train_shakespeare_char_cpu.py
#
# How it was chosen (trials and timings in BENCHMARKS.md):
# - On a CPU, time per step is the budget. Two layers cost ~35 ms a step against ~55 ms for
#   four, and over a one-minute run the shallower model ends lower: it gets more steps in.
# - A larger batch or bfloat16 autocast gave more tokens/s but fewer optimizer steps, and ended
#   higher at equal time; so did torch.compile, whose ~45 s of compilation a short run never repays.
# - A small model trained briefly tolerates a high learning rate: 5e-3 beat 1e-3, 2e-3 and 3e-3
#   at equal steps; 8e-3 started to lose.
# - Muon on the blocks' matrices (AdamW keeps the embeddings and norms) costs about as much per
#   step as AdamW and needs about half the steps: val 1.88 after ~700 steps against ~1,300 for
#   AdamW. muon_lr 0.015, 0.02 and 0.03 ended within 0.01 of each other; 0.05 lost. The WSD
#   schedule ended level with cosine, so cosine stays.
#   AdamW is one key away: --optimizer=adamw (it needs --max_iters=1400 --lr_decay_iters=1400 for val ~1.83).

out_dir = "out-shakespeare-char-cpu"
dataset = "shakespeare_char"
device = "cpu"
compile = False

n_layer = 2
n_head = 4
n_embd = 128
block_size = 64  # characters of context
batch_size = 12
gradient_accumulation_steps = 1
dropout = 0.0  # under one epoch of data: nothing to regularize yet

optimizer = "muon"
muon_lr = 0.02
learning_rate = 5e-3  # AdamW's part: embeddings, norms
min_lr = 5e-4
beta2 = 0.99
warmup_iters = 50
max_iters = 750
lr_decay_iters = 750

eval_interval = 250  # three cheap evals show the curve
eval_iters = 20
log_interval = 50
always_save_checkpoint = False
