# The chat demo: a 0.46M-parameter GPT learns, from scratch, to follow a turn of four synthetic
# intents (greet, repeat, reverse, recall a name from an earlier turn; data/chat/synthetic.py),
# and answers 193 of 200 held-out prompts made of words it never saw. The whole path, ~70 s on
# 2 CPU cores (training ~60 s of it):
#   python data/chat/synthetic.py --out_dir=data/chat_demo --n=60000
#   python data/train_tokenizer.py --input data/chat_demo/text.txt --vocab_size=512 --out_dir=data/chat_demo
#   python data/chat/prepare.py --input data/chat_demo/train.jsonl --tokenizer=data/chat_demo/tokenizer.json \
#       --out_dir=data/chat_demo --block_size=128
#   python train.py config/chat_demo_cpu.py
#   python chat.py --out_dir=out-chat-demo
#   python scripts/chat_eval.py --out_dir=out-chat-demo --heldout=data/chat_demo/heldout.jsonl   # accuracy
#
# How it was chosen (BENCHMARKS.md, "The chat demo on a CPU", has the runs):
# - The replies are copied from the prompt, so the model must learn to copy (induction heads)
#   rather than remember words: 60,000 conversations are about one pass at 1,200 steps; 20,000
#   seen three times answered 188 of 200 held-out prompts against 193.
# - The plain GPT-2 block exports as a GPT2LMHeadModel (python hf.py). RoPE (189/200) and the
#   whole Llama block (RoPE, RMSNorm, SwiGLU: 192/200, 20% slower) did no better here.
# - Two layers are the fewest that can copy. The quick start's Muon settings
#   (config/train_shakespeare_char_cpu.py) carried over.

out_dir = "out-chat-demo"
dataset = "chat_demo"  # data/chat_demo, made by the commands above
device = "cpu"
compile = False

n_layer = 2
n_head = 4
n_embd = 128
block_size = 128  # a conversation is ~40 tokens: rows hold about three, whole
batch_size = 16
gradient_accumulation_steps = 1
dropout = 0.0  # one pass over the data: nothing to regularize

optimizer = "muon"
muon_lr = 0.02
muon_momentum = 0.9
learning_rate = 5e-3  # AdamW's part: embeddings, norms
min_lr = 5e-4
beta2 = 0.99
warmup_iters = 10
max_iters = 1200
lr_decay_iters = 1200

eval_interval = 600
eval_iters = 10
log_interval = 100
always_save_checkpoint = False
