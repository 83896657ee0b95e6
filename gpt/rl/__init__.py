"""Reinforcement learning on a chat model (rl.py): tasks with a checker, rollouts and the policy gradient, pass@k."""
