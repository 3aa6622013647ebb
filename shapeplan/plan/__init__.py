"""The pure planning core: plain functions over row lengths and configs, returning frozen dataclasses.

Nothing here imports torch, TRL, transformers, datasets or click (a test checks it).
"""
