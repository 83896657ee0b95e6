# config/train_llama_1b.py's architecture at a size a CPU trains in a minute: RoPE (same base),
# RMSNorm, SwiGLU 4x wide, four query heads per key/value head, no biases, tied embeddings. For
# trying the Llama options and for the tests; on tiny Shakespeare:
#   python data/shakespeare_char/prepare.py
#   python train.py config/train_llama_tiny.py

out_dir = "out-llama-tiny"
dataset = "shakespeare_char"
device = "cpu"
compile = False

n_layer = 2
n_head = 4
n_kv_head = 1
n_embd = 64
mlp = "swiglu"
mlp_hidden = 256
pos_encoding = "rope"
rope_theta = 500000.0
norm = "rmsnorm"
bias = False
tie_embeddings = True
dropout = 0.0

block_size = 64
batch_size = 12
gradient_accumulation_steps = 1

learning_rate = 5e-3  # a small model trained briefly takes a high rate (see train_shakespeare_char_cpu.py)
min_lr = 5e-4
beta2 = 0.99
warmup_iters = 50
max_iters = 1000
lr_decay_iters = 1000

eval_interval = 250
eval_iters = 20
log_interval = 50
always_save_checkpoint = False
