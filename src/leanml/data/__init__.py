"""Data: text corpora, offline packaged datasets, CTR data."""
