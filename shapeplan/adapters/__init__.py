"""Adapters: the only modules that import TRL, transformers, accelerate, datasets or torch.

They turn command-line arguments, datasets and tokenizers into the plain values the planning core takes.
"""
