"""Text to ids and back, the token files, the chat template, and the rows that training and evaluation read."""
