# The RL demo's second stage (make rl-demo): rl.py on config/rl_demo_sft_cpu.py's chat model, the
# generated arithmetic task (gpt/rl/tasks.py), pass@1..8 on 100 held-out problems whose numbers the
# model never saw, every 20 steps. nanochat's chat_rl.py takes 16 samples of 1 problem at a time,
# 16 problems a step; a CPU takes 8 x 8.

out_dir = "out-rl-demo"
start_from = "out-rl-demo-sft"  # the SFT run's best checkpoint
task = "arithmetic"
device = "cpu"

examples_per_step = 8
samples = 8
max_new_tokens = 24  # an answer is ~15 tokens
temperature = 1.0
eval_examples = 100
pass_k = 8

learning_rate = 1e-3  # AdamW's, cosine to 0 over the run (nanochat: a linear ramp to 0)
warmup_iters = 0
max_iters = 60
lr_decay_iters = 60
min_lr = 0.0
weight_decay = 0.0
eval_interval = 20
log_interval = 1
