# Finetune released GPT-2 weights on tiny Shakespeare (GPT-2 BPE), nanoGPT's recipe: a few
# minutes on one GPU.
#   python data/shakespeare/prepare.py
#   python train.py config/finetune_shakespeare.py
#   python train.py config/finetune_shakespeare.py --init_from=gpt2   # 124M: a small GPU, or a CPU (slowly)
#   python sample.py --out_dir=out-shakespeare --start="ROMEO:"
# init_from can also be a local Hugging Face GPT-2 directory (no download).
# The model's shape (n_layer, n_head, n_embd, bias, vocab) comes from the weights.

out_dir = "out-shakespeare"
eval_interval = 5  # 20 steps in all: look often
eval_iters = 40
wandb_log = False
wandb_project = "shakespeare"
wandb_run_name = "ft-gpt2-xl"

dataset = "shakespeare"
# gpt2-xl (1.5B), as nanoGPT: the largest GPT-2 writes the best Shakespeare, and with batch 1
# its weights, gradients and AdamW state (~25 GB) plus one sequence's activations fit a 40 GB GPU
init_from = "gpt2-xl"
always_save_checkpoint = False  # ~300k tokens of text: the model soon overfits, keep the best val

# 1 sequence x 1024 tokens x 32 micro-steps = 32,768 tokens per step; 20 steps = ~655k tokens,
# about two passes over the training text
batch_size = 1
gradient_accumulation_steps = 32
block_size = 1024
max_iters = 20

# finetuning: a small constant rate nudges the pretrained weights instead of overwriting them
learning_rate = 3e-5
decay_lr = False
