"""Everything a run writes in out_dir: who may write it, checkpoints, the saver that writes them, metrics.jsonl."""
