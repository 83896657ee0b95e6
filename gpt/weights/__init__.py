"""Weights in and out: a run, a released GPT-2 or a Hugging Face model in; Hugging Face and GGUF out."""
