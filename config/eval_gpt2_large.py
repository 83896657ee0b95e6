# Evaluate the released gpt2-large (774M) on OpenWebText's validation split, without training.
#   python data/openwebtext/prepare.py
#   python train.py config/eval_gpt2_large.py
# nanoGPT measured val loss ~2.67 this way.

out_dir = "out-eval-gpt2-large"  # its own directory: an eval writes metrics.jsonl, which must not replace a run's
init_from = "gpt2-large"
eval_only = True
dataset = "openwebtext"
batch_size = 8
eval_iters = 500  # 500 x 8 x 1024 = ~4M tokens per split: the loss to about two decimals
wandb_log = False
