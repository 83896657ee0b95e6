"""Evaluations: the tasks, CORE, the scorer they share, the watcher, and bench.py --against's comparison."""
