# The RL demo's first stage (make rl-demo): a 0.4M-parameter chat model SFT'd from scratch on the
# generated arithmetic word problems (data/chat/arithmetic.py: "Ava has 3 apples. ..." -> "3 + 4 - 2 = 5
# #### 5"), stopped early on purpose, so that RL (config/rl_demo_cpu.py) has room to raise its pass@1:
#   python data/chat/arithmetic.py --out_dir=data/rl_demo --n=20000
#   python data/train_tokenizer.py --input data/rl_demo/text.txt --vocab_size=512 --out_dir=data/rl_demo
#   python data/chat/prepare.py --input data/rl_demo/train.jsonl --tokenizer=data/rl_demo/tokenizer.json \
#       --out_dir=data/rl_demo --block_size=64
#   python train.py config/rl_demo_sft_cpu.py
#   python scripts/chat_rl.py config/rl_demo_cpu.py
# The shape and Muon settings are the chat demo's (config/chat_demo_cpu.py); a conversation is ~45 tokens.
# 300 steps (~2.5 min on 2 busy cores) reach val loss 0.05: held-out pass@1 0.45 at temperature 1 and
# 0.81 greedy, so sampling, not the format, is what the model gets wrong: what RL can sharpen.

out_dir = "out-rl-demo-sft"
dataset = "rl_demo"
device = "cpu"
compile = False

n_layer = 2
n_head = 4
n_embd = 128
block_size = 64
batch_size = 16
gradient_accumulation_steps = 1
dropout = 0.0

optimizer = "muon"
muon_lr = 0.02
muon_momentum = 0.9
learning_rate = 5e-3
min_lr = 5e-4
beta2 = 0.99
warmup_iters = 10
max_iters = 300
lr_decay_iters = 300

eval_interval = 300
eval_iters = 10
log_interval = 50
always_save_checkpoint = False
