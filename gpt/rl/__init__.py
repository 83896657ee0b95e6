"""Reinforcement learning on a chat model (scripts/chat_rl.py): tasks with a checker, rollouts and the policy gradient, pass@k."""
