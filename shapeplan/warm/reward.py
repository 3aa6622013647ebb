"""The Reward warmer (the shared preference warm-up: warm/preference.py)."""

from __future__ import annotations

from typing import Any

from .preference import PreferenceWarmer
from .synthetic import token_ids


class RewardWarmer(PreferenceWarmer):
    """Reward: TRL's RewardTrainer skips its preparation for rows that have chosen_ids/rejected_ids."""

    def example(self, counts: tuple[int, ...], offset: int) -> dict[str, Any]:
        prompt, chosen, rejected = counts
        vocab = self.tokenizer.vocab_size
        return {"chosen_ids": token_ids(prompt + chosen, vocab, offset),
                "rejected_ids": token_ids(prompt + rejected, vocab, offset + 1)}
