# The speedrun recipe (config/speedrun_gpt2.py) at CPU scale: the same levers and data order on
# Shakespeare in GPT-2's tokens. It is the recipe's smoke test on a laptop, not a result about GPT-2
# scale. A CPU step is dominated by the 50,257-wide logits (the soft-cap's tanh, the softmax), not
# by the 4 small blocks: seconds a step on 2 shared cores, so 200 steps take minutes.
#   python data/shakespeare/prepare.py
#   python train.py config/speedrun_shakespeare_cpu.py
#   python bench.py config/speedrun_shakespeare_cpu.py --against="--mlp=gelu" --seeds=5

out_dir = "out-speedrun-shakespeare-cpu"
dataset = "shakespeare"  # 295k train tokens; its speeches end in <|endoftext|>: documents
device = "cpu"
compile = False
dtype = "float32"

batch_size = 8
block_size = 64
gradient_accumulation_steps = 1
batch_order = "documents"
doc_mask = True

n_layer = 4
n_head = 4
n_embd = 128
bias = False
dropout = 0.0
pos_encoding = "rope"
norm = "rmsnorm"
qk_norm = True
mlp = "relu2"
tie_embeddings = False
zero_init_proj = True
logit_softcap = 15.0
value_embeds = True
unet_skips = True

optimizer = "muon"
muon_lr = 0.02
muon_momentum = 0.9
learning_rate = 3e-3
min_lr = 3e-4
weight_decay = 0.0
beta2 = 0.99
lr_schedule = "wsd"
decay_frac = 0.4
warmup_iters = 10
max_iters = 200

eval_interval = 100
eval_iters = 10
log_interval = 25
always_save_checkpoint = False
