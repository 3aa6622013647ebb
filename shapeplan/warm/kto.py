"""The KTO warmer (the shared preference warm-up: warm/preference.py). KTO's metrics count desirable rows and the
completion tokens of each side, and each step runs the KL rows too: the synthetic batches meet every planned count
and KL length."""

from __future__ import annotations

from typing import Any, ClassVar

from ..plan.model import Phase, Plan
from .model import WarmTask
from .preference import PRECOMPUTE, PairedBatch, PreferenceWarmer, taking_prepared_rows
from .runner import WARMED_PHASES
from .synthetic import token_ids


def kto_batch(rows: int, longest: int, kl_longest: int | None, desirable: int, counts: tuple[int, int]
              ) -> PairedBatch | None:
    """B KTO rows, the first `desirable` of them desirable, whose completions hold `counts` tokens (desirable,
    undesirable), whose longest row is `longest` and longest KL row `kl_longest` (None: no KL rows); None when
    they do not fit.

    One row (the carrier) is both longest: prompt `longest - c` and KL completion `kl_longest - prompt`, which needs
    its completion c >= longest - kl_longest; the other rows have a one-token prompt and an empty KL completion.
    """
    kl = kl_longest if kl_longest is not None else longest
    room = longest - 1  # completion tokens a row can hold: a one-token prompt at least
    forced = max(0, longest - kl)
    sizes = (desirable, rows - desirable)
    for side in (0, 1):
        if sizes[side] == 0 or any(sizes[s] * room < counts[s] for s in (0, 1)) or counts[side] < forced:
            continue
        need = list(counts)
        carried = min(room, need[side])
        need[side] -= carried
        out = []
        carrier = 0 if side == 0 else desirable
        for i in range(rows):
            s = 0 if i < desirable else 1
            if i == carrier:
                prompt = longest - carried
                out.append((prompt, carried, kl - prompt, int(s == 0)))
                continue
            take = min(room, need[s])
            need[s] -= take
            out.append((1, take, 0, int(s == 0)))
        return PairedBatch(tuple(out))
    return None


class KTOWarmer(PreferenceWarmer):
    """KTO: each step runs the policy on the KL rows and on the rows, then the reference model on both. A planned
    `kl` (`eval_kl`) shape is run by the `train` (`eval`) step of a shape with as many rows: each such shape's
    batches take the KL lengths in turn."""

    inner_phases: ClassVar[dict[str, str]] = {"ref": "train", "kl": "train", "ref_kl": "train", "eval_ref": "eval",
                                              "eval_kl": "eval", "eval_ref_kl": "eval"}
    phases = (*WARMED_PHASES, PRECOMPUTE)
    ref_columns = ("ref_logps", "ref_KL_logps")
    rows_per_example = 1

    def bind(self, plan: Plan) -> None:
        # (host phase, batch, seq) -> the KL seqs its batches carry: every KL shape goes to a host shape of its rows
        self._kl: dict[tuple[str, int, int], list[int]] = {}
        hosts_of: tuple[tuple[Phase, Phase], ...] = (("train", "kl"), ("eval", "eval_kl"))
        for host, kl_phase in hosts_of:
            for batch in {s.batch for s in plan.by_phase(host)}:
                hosts = sorted(s.seq for s in plan.by_phase(host) if s.batch == batch)
                kls = sorted(s.seq for s in plan.by_phase(kl_phase) if s.batch == batch)
                for i, seq in enumerate(kls):
                    self._kl.setdefault((host, batch, hosts[i % len(hosts)]), []).append(seq)
        super().bind(plan)

    def layouts(self, task: WarmTask) -> list[PairedBatch]:
        """Batches that meet every planned desirable-row count, completion-token count and KL length of the task:
        the counts in pairs (the large with the small, so that the carrier row's completion fits), then a batch for
        each value no pair could place."""
        cap = self.config.max_length
        multiple = self.config.pad_to_multiple_of

        def longest(seq: int) -> int:
            padded = seq - 1 if multiple not in (None, 1) and seq > 1 else seq
            return min(padded, cap) if cap is not None else padded

        kl_seqs: list[int | None] = list(self._kl.get((task.phase, task.batch, task.seq), [])) or [None]
        chosen = list(task.chosen_rows) or [0]
        values = sorted(task.completion_tokens, reverse=True) or [0]
        pairs = [(values[i], values[-1 - i]) for i in range((len(values) + 1) // 2)]
        out: list[PairedBatch] = []
        used: set[object] = set()

        def place(kl_seq: int | None, ks: list[int], counts: list[tuple[int, int]]) -> None:
            for k in ks:
                for pair in counts:
                    batch = kto_batch(task.batch, longest(task.seq), None if kl_seq is None else longest(kl_seq),
                                      k, pair)
                    if batch is not None:
                        out.append(batch)
                        used.update({("kl", kl_seq), ("k", k), ("v", pair[0]), ("v", pair[1])})
                        return

        for j in range(max(len(kl_seqs), len(chosen), len(pairs))):
            big, small = pairs[j % len(pairs)]
            place(kl_seqs[j % len(kl_seqs)], [chosen[j % len(chosen)], *chosen], [(big, small), (small, big)])
        for kl_seq in kl_seqs:
            if ("kl", kl_seq) not in used:
                place(kl_seq, chosen, [(v, w) for v in values for w in values])
        for k in chosen:
            if ("k", k) not in used:
                place(kl_seqs[0], [k], [(v, w) for v in values for w in values])
        for v in values:
            if ("v", v) not in used:
                place(kl_seqs[0], chosen, [(v, w) for w in values] + [(w, v) for w in values])
        return out

    def example(self, counts: tuple[int, ...], offset: int) -> dict[str, Any]:
        prompt, completion, kl_completion, desirable = counts
        vocab = self.tokenizer.vocab_size
        return {"prompt_ids": token_ids(prompt, vocab, offset), "completion_ids": token_ids(completion, vocab, offset),
                "KL_completion_ids": token_ids(kl_completion, vocab, offset + 1), "label": bool(desirable)}

    def trainer_type(self) -> Any:
        return taking_prepared_rows(super().trainer_type())

