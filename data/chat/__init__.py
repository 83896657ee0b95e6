"""Chat data: template.py (a conversation <-> token ids and training mask) and prepare.py (a
jsonl of conversations -> token files, masks and meta.json)."""
