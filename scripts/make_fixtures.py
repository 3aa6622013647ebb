"""Regenerate the small preference test fixtures in tests/fixtures/, in the formats TRL's trainers read:

- preference-conversational.jsonl: trl-lib/ultrafeedback_binarized style, `chosen`/`rejected` message lists that
  share their user turns (an implicit prompt);
- preference-explicit.jsonl: plain-text `prompt`/`chosen`/`rejected`;
- kto-unpaired.jsonl: trl-lib/kto-mix-14k style, conversational `prompt`/`completion` with a boolean `label`.

Lengths spread over several multiples of 128 tokens of the tiny tokenizer, and a few prompts are long enough for a
small max_length to drop their rows. Run from the repository root: `python scripts/make_fixtures.py`; the output is
committed.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
# The words the tiny tokenizer was trained on (scripts/make_examples.py), so rows stay a few hundred tokens long.
WORDS = (  # noqa: SIM905  (a sentence reads better than a list of 90 quoted words)
         "the model learns to answer every question with care and detail while the trainer pads each batch "
         "to a multiple of one hundred twenty eight tokens so that trainium compiles a graph once and reuses it "
         "many times during a long run on a cluster of accelerators users ask about math code stories recipes "
         "travel history science music and their favourite books").split()
ROWS = 40


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(sentence(rng, rng.randint(4, 12)) for _ in range(rng.randint(lo, hi)))


def prompt_text(rng: random.Random) -> str:
    # One row in eight has a long prompt, which max_length=256 drops.
    return text(rng, 14, 20) if rng.random() < 0.125 else text(rng, 1, 6)


def user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


def assistant(content: str) -> dict[str, str]:
    return {"role": "assistant", "content": content}


def write(name: str, rows: list[dict[str, object]]) -> None:
    with open(OUT / name, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rng = random.Random(7)
    conversational = []
    for _ in range(ROWS):
        turns = [user(prompt_text(rng))]
        if rng.random() < 0.25:  # a multi-turn prompt
            turns += [assistant(text(rng, 1, 3)), user(text(rng, 1, 2))]
        conversational.append({"chosen": [*turns, assistant(text(rng, 1, 10))],
                               "rejected": [*turns, assistant(text(rng, 1, 10))]})
    write("preference-conversational.jsonl", conversational)

    explicit = [{"prompt": f"Question: {prompt_text(rng)}\nAnswer:", "chosen": " " + text(rng, 1, 9),
                 "rejected": " " + text(rng, 1, 9)} for _ in range(ROWS)]
    write("preference-explicit.jsonl", explicit)

    unpaired = [{"prompt": [user(prompt_text(rng))], "completion": [assistant(text(rng, 1, 10))],
                 "label": rng.random() < 0.6} for _ in range(ROWS)]
    write("kto-unpaired.jsonl", unpaired)


if __name__ == "__main__":
    main()
