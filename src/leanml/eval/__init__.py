"""Evaluation: perplexity (SparseGPT protocol)."""
