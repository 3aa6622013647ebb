"""The plan: every input shape a training run feeds the model, with how often and when it first appears."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, get_args

# The TRL methods shapeplan knows; shapeplan.services.trainers holds what it knows about each.
Method = Literal["sft", "grpo", "rloo", "dpo", "kto", "reward", "distillation"]

# What the model runs on a shape. `train` is forward + backward; every other phase is a no-grad forward
# (`generate` and `eval_generate`: a static-cache `generate` call). `eval_*` phases run inside the eval loop, so
# their first_step counts as eval's does; `ref_precompute` runs before training (first_step 0).
Phase = Literal[
    "train", "eval", "generate", "eval_generate", "old_logprob", "ref", "eval_ref", "ref_precompute", "kl", "eval_kl",
    "ref_kl", "eval_ref_kl", "teacher", "eval_teacher"
]
PHASES: tuple[Phase, ...] = get_args(Phase)  # in report order

# What a method's token lengths (advise, `analyze --histogram`) count: "rows", the prepared train rows, which
# max_length truncates; "prompts", the train prompts of a generating trainer.
LengthKind = Literal["rows", "prompts"]
METHODS: tuple[Method, ...] = get_args(Method)  # shapeplan.services.trainers holds one TrainerSpec for each

# The phases that are a static-cache `generate` call (train side and eval side): a generate size each.
GENERATE_PHASES: tuple[Phase, ...] = ("generate", "eval_generate")


class ShapeKey(NamedTuple):
    """What makes two shapes the same compiled graph: the phase, the dimensions and the generate sizes."""

    phase: Phase
    batch: int
    seq: int
    cache_len: int | None = None
    max_new_tokens: int | None = None
    logits_to_keep: int | None = None
    images: tuple[tuple[int, ...], ...] = ()  # vision batches: each image's key (plan/vision), in row order
    pixel_values: tuple[int, ...] | None = None  # vision batches: the pixel tensor's shape


@dataclass(frozen=True, slots=True)
class Shape:
    """One input shape the run meets, aggregated over every micro-batch (and rank) that has it.

    `first_step` is the optimizer step (1-based, as the Trainer counts) during which a train-side shape is first
    met, or after which an eval-side shape is first met; 0 means before the first step (`eval_on_start`).
    `certain` is False for shapes that only sampling (GRPO completion buckets) or the model's tool calls can
    produce; their `count` is the most the run can meet. A certain shape that tool calls can also produce carries
    `max_count`, the most the run can meet it (`count` and `first_step` are those of its certain occurrences).
    Padding-free batches also carry the per-batch values that can trigger a compile under `torch.compile`:
    the lengths of `cu_seq_lens` and the values of `max_length_q` met with this shape, and `varlen_pairs`: the
    (len(cu_seq_lens), max_length_q) pairs met together (each pair is a graph of its own under `torch.compile`).
    `unpadded` counts the micro-batches of this shape that hold no padding: every row `seq` real tokens (padded
    batches) or one document without pad (padding-free). Attention skips the mask for them (SDPA's is_causal), so
    they dispatch other ops than the padded batches of the same shape.
    DPO's policy forwards carry `completion_tokens`: the completion-token counts of the chosen and of the rejected
    half of the batches met with this shape. TRL's metrics select those tokens with a boolean mask, so each count
    is an op input of its own size (a compile each on an eager device). KTO's carry them too (desirable and
    undesirable rows), and `chosen_rows`: the numbers of desirable rows its batches had, which KTO's loss selects.
    Batches with images (vision-language runs) carry what the vision tower receives: `images`, each image's key
    in the batch's row order, as its family defines it (`shapeplan.plan.vision`: Qwen-VL's `image_grid_thw` row,
    a tiling family's tile counts); the shape of `pixel_values` (Qwen-VL: (N, D), every image's patch rows
    concatenated); and `vision_inputs`, every other tensor the images add (name and shape). Keys and pixel shape
    are part of the shape's key (Qwen-VL's tower windows attention by each image's grid, not only by N).
    Vision SFT batches also carry `text_runs`: each distinct layout the shape's batches had, as every row's text
    tokens before, between and after its images (the row's images being the next ones of `images`).
    Qwen-VL's forward builds each row's position ids from these runs op by op on the device, so every layout is
    ops of its own sizes on an eager device.
    """

    phase: Phase
    batch: int
    seq: int
    count: int
    first_step: int
    certain: bool = True
    max_count: int | None = None
    cache_len: int | None = None
    max_new_tokens: int | None = None
    logits_to_keep: int | None = None
    cu_seq_lens: tuple[int, ...] = ()
    max_length_q: tuple[int, ...] = ()
    varlen_pairs: tuple[tuple[int, int], ...] = ()
    unpadded: int = 0
    completion_tokens: tuple[int, ...] = ()
    chosen_rows: tuple[int, ...] = ()
    pixel_values: tuple[int, ...] | None = None
    images: tuple[tuple[int, ...], ...] = ()
    vision_inputs: tuple[tuple[str, tuple[int, ...]], ...] = ()
    text_runs: tuple[tuple[tuple[int, ...], ...], ...] = ()

    @property
    def key(self) -> ShapeKey:
        return ShapeKey(self.phase, self.batch, self.seq, self.cache_len, self.max_new_tokens, self.logits_to_keep,
                        self.images, self.pixel_values)

    @property
    def image_grid_thw(self) -> tuple[tuple[int, ...], ...]:
        """Qwen-VL's name for its images' keys (each its `image_grid_thw` row), as plans name them."""
        return self.images


@dataclass(frozen=True, slots=True)
class PlanStats:
    """Token accounting of the train phase: `tokens` real tokens, `padded_tokens` what the batches hold; and the
    eval loop: `evaluations` passes over `eval_rows` rows (0 and 0 without one)."""

    rows: int
    dropped_rows: int
    micro_batches: int
    optimizer_steps: int
    tokens: int
    padded_tokens: int
    evaluations: int = 0
    eval_rows: int = 0

    @property
    def padding_waste(self) -> float:
        return 0.0 if self.padded_tokens == 0 else 1.0 - self.tokens / self.padded_tokens


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything `shapeplan warm` needs and a person wants to see before a run.

    `exact` is False when the order of batches cannot be replayed and `shapes` is the set of reachable shapes
    (a bound), not the run's exact shapes and counts. `config` holds the TRL options that shape the graphs;
    `fingerprint` identifies the model, tokenizer and data the plan was made from. `observed` marks a run record:
    the shapes a guarded run met, merged over its ranks as a plan merges them.
    """

    method: Method
    exact: bool
    pad_to_multiple_of: int | None
    shapes: tuple[Shape, ...]
    stats: PlanStats
    config: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    fingerprint: dict[str, str] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    observed: bool = False  # a run record (`shapeplan guard --record`): what a real run met, not a prediction

    def by_phase(self, phase: Phase) -> tuple[Shape, ...]:
        return tuple(s for s in self.shapes if s.phase == phase)

    @property
    def distinct_shapes(self) -> int:
        return len({s.key for s in self.shapes})

    @property
    def vision_graphs(self) -> int:
        """Distinct vision-tower inputs: one per image batch (its images' keys and its pixel tensor's shape)."""
        return len({(s.images, s.pixel_values) for s in self.shapes if s.pixel_values is not None})


def shape_key(shape: Shape, *, images: bool = True) -> tuple[Any, ...]:
    """What a run shows of a shape (the guard's key of a forward): its key without max_new_tokens (a generate's
    setting, not seen); `images=False`: without its images' keys, for a family whose batches do not hold them (its
    pixel tensor's shape then stands for them)."""
    return (shape.phase, shape.batch, shape.seq, shape.cache_len, shape.logits_to_keep,
            shape.images if images else (), shape.pixel_values)
