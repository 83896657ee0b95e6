# Supervised fine-tuning (SFT): GPT-2 124M into a chat model, on HuggingFaceTB/smol-smoltalk
# (the SmolTalk conversations filtered for small models, as nanochat's SFT uses; Apache-2.0):
#   python data/chat/prepare.py --dataset=HuggingFaceTB/smol-smoltalk --val_split=test --out_dir=data/smoltalk
#   python train.py config/sft_gpt2_smoltalk.py
#   python chat.py --out_dir=out-sft-gpt2-smoltalk
#   python hf.py --out_dir=out-sft-gpt2-smoltalk        # a GPT2LMHeadModel with the chat template
# prepare.py uses GPT-2's BPE by default; the four turn tokens become ids 50257-50260, which
# init_from='gpt2' takes from the embedding's padding rows, each starting as the mean embedding.
# One GPU; the model's shape comes from the weights.

out_dir = "out-sft-gpt2-smoltalk"
dataset = "smoltalk"
init_from = "gpt2"  # or a local copy: init_from='/path/to/gpt2'; a model pretrained here: its out_dir's export

# Rows start at a conversation's start and hold whole conversations (batches.ChatBatches); train.py
# prints the share of padding at start. 16 x 1024 x 8 = 131,072 row positions per optimizer step:
# in the 64k-130k range SFT recipes use, and enough assistant tokens per step (the loss is their
# mean) for a steady gradient. With less GPU memory: batch_size=8, gradient_accumulation_steps=16.
block_size = 1024  # GPT-2's context, and prepare.py's default --block_size
batch_size = 16
gradient_accumulation_steps = 8

# 3,000 steps are ~390M row positions. SFT wants 1-2 epochs: prepare.py prints the train tokens;
# one epoch is about that / (131,072 x (1 - the padding share)) steps: set max_iters from it.
max_iters = 3000
lr_decay_iters = 3000
warmup_iters = 100  # the turn tokens' rows start as an average token: no large early steps
# A small rate adjusts the pretrained weights instead of overwriting them: 3e-5 is in the middle
# of the 1e-5..5e-5 that full fine-tunes of models this size use; cosine down to a tenth.
learning_rate = 3e-5
min_lr = 3e-6
weight_decay = 0.0  # decay would pull the pretrained weights toward zero, not toward where they were
dropout = 0.0  # 1-2 passes over ~0.5M conversations: little to overfit
grad_clip = 1.0

eval_interval = 250
eval_iters = 50  # val: the test split's conversations, assistant tokens only
always_save_checkpoint = False  # ckpt_best.pt, chat.py's default, is the lowest val loss
log_interval = 10
