"""Chat data: synthetic.py (the chat demo's conversations) and prepare.py (a jsonl of
conversations -> token files, masks and meta.json, rendered by gpt/data/chat_template.py)."""
