# The RL demo's second stage (make rl-demo): scripts/chat_rl.py on config/rl_demo_sft_cpu.py's chat model, the
# generated arithmetic task (gpt/rl/tasks.py), pass@1..8 on 100 held-out problems whose numbers the
# model never saw, at iters 0, 20 and 40. nanochat's chat_rl.py takes 16 samples of 1 problem at a
# time, 16 problems a step; a CPU takes 8 x 16.
# What to expect (BENCHMARKS.md, "RL on the CPU"): the SFT model is right 45% of the time at
# temperature 1 and 81% greedily; 40 steps raise held-out pass@1 by about 0.02 (4 seeds: 95%
# [+0.006, +0.037]) and keep pass@8. A small, real gain: a demo of the machinery more than of RL.

out_dir = "out-rl-demo"
start_from = "out-rl-demo-sft"  # the SFT run's best checkpoint
task = "arithmetic"
device = "cpu"

examples_per_step = 8
samples = 16  # 8 left the gradient noisier than its signal: AdamW 3e-4 cut pass@8 0.98 -> 0.84 in 20 steps
max_new_tokens = 24  # an answer is 15 tokens
temperature = 1.0
eval_examples = 100
pass_k = 8

# Muon for the blocks' matrices, as in SFT, at a tenth of SFT's rate, AdamW for the rest; both cosine
# to 0 (nanochat: a linear ramp to 0). AdamW alone, from the same SFT model: 1e-3 collapsed the
# reward within 8 steps (its first, sign-like step zeroes problems it got right), 3e-4 lowered
# pass@8 without raising pass@1, 2e-4 gave +0.022 over 4 seeds but p = 0.12 and pass@8 down to
# 0.90-0.97. The gradient itself is right: on 4 fixed problems AdamW 1e-4 lifts their reward from
# 0.5 to about 0.75 in 12 steps; held-out problems need more steps than a demo has.
optimizer = "muon"
muon_lr = 0.002
learning_rate = 1e-4
warmup_iters = 0
max_iters = 40  # ~2.5 s a step alone on 2 busy cores: the RL stage takes about 3 minutes
lr_decay_iters = 40
min_lr = 0.0
weight_decay = 0.0
eval_interval = 20
log_interval = 1
