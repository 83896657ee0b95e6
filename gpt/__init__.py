"""The trainer's library: one module per job. The commands at the repository's root (train.py,
sample.py, chat.py, serve.py, eval.py, hf.py, bench.py, plot.py) call it; it calls model.py and
configurator.py, and never a command."""
