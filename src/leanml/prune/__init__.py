"""Post-training LLM pruning: a layer-wise engine, masks, and pruning methods."""
