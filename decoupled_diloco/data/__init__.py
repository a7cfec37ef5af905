"""Corpora (synthetic Markov, text file, TFDS), the byte tokenizer and per-learner batches."""
