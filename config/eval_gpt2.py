# Evaluate the released gpt2 (124M) on OpenWebText's validation split, without training.
#   python data/openwebtext/prepare.py
#   python train.py config/eval_gpt2.py
# nanoGPT measured val loss ~3.12 this way.

out_dir = "out-eval-gpt2"  # its own directory: an eval writes metrics.jsonl, which must not replace a run's
init_from = "gpt2"
eval_only = True
dataset = "openwebtext"
batch_size = 8
eval_iters = 500  # 500 x 8 x 1024 = ~4M tokens per split: the loss to about two decimals
wandb_log = False
