# The baby GPT: a 10.7M-parameter character-level model on tiny Shakespeare.
# A few minutes on one GPU:  python train.py config/train_shakespeare_char.py
# On a CPU, use config/train_shakespeare_char_cpu.py instead.

out_dir = "out-shakespeare-char"
eval_interval = 250  # the data is tiny, so it overfits fast: watch val often
eval_iters = 200
log_interval = 10
always_save_checkpoint = False  # ckpt.pt only when val improves (and at the end)

wandb_log = False
wandb_project = "shakespeare-char"
wandb_run_name = "mini-gpt"

dataset = "shakespeare_char"
gradient_accumulation_steps = 1
batch_size = 64
block_size = 256  # characters of context

n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2  # a small dataset: regularize

learning_rate = 1e-3  # small models tolerate a higher rate
max_iters = 5000
lr_decay_iters = 5000  # decay over the whole run
min_lr = 1e-4  # learning_rate / 10
beta2 = 0.99  # few tokens per step: a longer second-moment average steadies the update

warmup_iters = 100
