"""Content IDs: quantize an item's content (an ad image, a text embedding) into ``M`` discrete IDs.

- ``encoders``: :class:`SmallCNN`, :class:`MLPEncoder`, :class:`ContentEncoder`, ``embed_texts`` (MiniLM)
- ``quantizer``: :class:`SoftProductQuantizer` and pure functions (soft/hard assignment, k-means, usage stats)
- ``trainer``: :func:`fit_content_ids` (text supervision: InfoNCE or caption-token classification)
- ``assign``: :func:`assign_visual_ids`, :func:`write_visual_ids` / :func:`read_visual_ids` (Parquet)
"""
