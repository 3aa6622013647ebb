"""The `trl <method>` command that runs a planned run as printed (advise's "run it", warm's next step).

`trl <method>` loads `--dataset_name` with `datasets.load_dataset(NAME)`, which reads a Hub id or a dataset folder
but not a data file, and takes the eval rows from that dataset's `dataset_test_split`. A `datasets:` mixture in a
`--config` file cannot carry a separate eval file: TRL concatenates every entry into `train`. So a local data file
(and the eval file given with `--eval-dataset`) becomes a dataset folder that holds only a README.md whose YAML
header names each file as a split (`configs: data_files`), which `load_dataset(folder)` reads. The folder lives
under the cache root, named by what it names, so the command keeps working after the plan is gone.
"""

from __future__ import annotations

import hashlib
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..adapters.host import cache_root
from ..errors import CacheError
from ..plan.grpo import pin_kwargs, pinned_cache
from ..plan.io import write_atomic
from .trainers import trainer_spec

if TYPE_CHECKING:
    from ..plan.model import Plan

# A reward TRL's GRPO/RLOO scripts have registered, so that their command runs as printed; the note says to replace it.
PLACEHOLDER_REWARD = "think_format_reward"


@dataclass(frozen=True)
class TrlCommand:
    words: tuple[str, ...]  # ("trl", METHOD, *options)
    notes: tuple[str, ...]  # what the user must know or change before running it

    def line(self) -> str:
        return shlex.join(self.words)


def trl_command(method: str, argv: Sequence[str], *, eval_source: str | None = None,
                device: str | None = None, pin_cache: int | None = None) -> TrlCommand:
    """The `trl METHOD` command of the run shapeplan planned from `argv` (TRL's options) and `eval_source`, for
    training on `device` (None: the one TRL finds; "cpu": with `--use_cpu true`, without which TRL's bf16 default
    refuses a host with no accelerator); `pin_cache`: the cache length the plan pins (its `pin_cache`), which the
    command's `--generation_kwargs` then carries."""
    from ..adapters.generation import generation_kwargs
    from ..adapters.trl_args import parse_training_args

    args = parse_training_args(trainer_spec(method), argv)
    script, out, notes = args.script, list(argv), []
    pairs: list[tuple[str, str]] = []
    if "model_name_or_path" not in args.given:  # shapeplan's default model; TRL has none
        pairs.append(("model_name_or_path", str(args.model.model_name_or_path)))
    if "pad_to_multiple_of" not in args.given:  # planned at TRL's Neuron value; spelt out, it holds on any device
        pairs.append(("pad_to_multiple_of", str(args.training.pad_to_multiple_of)))
    if device == "cpu" and "use_cpu" not in args.given:
        pairs.append(("use_cpu", "true"))
    mixture = bool(args.dataset_mixture is not None and getattr(args.dataset_mixture, "datasets", None))
    splits = {}
    if not mixture and Path(script.dataset_name).is_file():
        splits[script.dataset_train_split] = script.dataset_name
    if eval_source is not None and str(getattr(args.training, "eval_strategy", "no")) != "no":
        if splits and Path(eval_source).is_file():
            test = script.dataset_test_split
            if test == script.dataset_train_split:  # one split name for both files: the eval file gets its own
                test = "eval" if test != "eval" else "test"
                pairs.append(("dataset_test_split", test))
            splits[test] = eval_source
        else:
            notes.append(f"`trl {method}` reads the eval rows from the {script.dataset_test_split!r} split of "
                         f"--dataset_name's dataset, not from {eval_source}: add them to it as that split")
    if splits:
        pairs.append(("dataset_name", str(dataset_folder(splits))))
    elif not mixture and "dataset_name" not in args.given:  # shapeplan's default dataset; TRL has none
        pairs.append(("dataset_name", str(script.dataset_name)))
    if pin_cache is not None:
        pairs.append(("generation_kwargs", pin_kwargs(generation_kwargs(args.training), pin_cache)))
    if args.agentic:
        out = _without_agentic_options(out)
        names = ", ".join(f"{k}={v}" for k, v in args.agentic.recorded().items() if v and k != "pad_tool_turns")
        notes.append(f"`trl {method}` cannot pass {names}: train with your own script, which hands them to the "
                     "trainer" + (", and call shapeplan.pad_tool_turns(trainer) before training (a ShapeGuard "
                                  "holding the plan does it)" if args.agentic.pads else "")
                     + "; the options above are the run's TRL options" + (
                         f", the plan's cache pin (max_cache_len {pin_cache}) among them" if pin_cache else "") + (
                         " (drop `tools:`, `environment_factory:`, `pad_tool_turns:` and `pin_cache:` from the "
                         "--config file for `trl`)" if "--config" in out else ""))
    if hasattr(script, "reward_funcs") and not script.reward_funcs and not script.reward_model_name_or_path:
        pairs.append(("reward_funcs", PLACEHOLDER_REWARD))
        notes.append(f"--reward_funcs {PLACEHOLDER_REWARD} is a placeholder so that the command runs: give your "
                     "reward functions (TRL registry names or dotted import paths) or --reward_model_name_or_path")
    return TrlCommand(words=("trl", method, *with_options(out, pairs, in_place=True)), notes=tuple(notes))


def training_command(plan: Plan, plan_path: str | None, *, eval_source: str | None, device: str,
                     python_lines: Sequence[str]) -> TrlCommand | None:
    """What `warm` prints to train with after warming `plan` (read from `plan_path`, None: made from options) on
    `device`: a script's run, its command under the guard; a `trl` run, its `trl <method>` command, under the guard
    where the warm-up needs `python_lines` (settings no environment variable carries, which the guard sets). None
    for a plan that names neither (written by hand)."""
    argv, script = plan.config.get("argv"), plan.config.get("command")
    if isinstance(script, list):
        return guarded_script(plan_path, script)
    if not isinstance(argv, list):
        return None
    recorded = plan.config.get("eval_dataset")  # a plan made with --eval-dataset
    eval_source = eval_source or (recorded if isinstance(recorded, str) else None)
    command = trl_command(plan.method, argv, eval_source=eval_source, device=device, pin_cache=pinned_cache(plan))
    if not python_lines:
        return command
    why = f"the guard sets what no environment variable can ({'; '.join(python_lines)}), so the run hits the " \
          "warmed graphs"
    if plan_path is None:
        return TrlCommand(words=command.words, notes=(f"train under `shapeplan guard --plan PLAN` (write PLAN with "
                                                      f"`shapeplan analyze -o PLAN ...`): {why}", *command.notes))
    return TrlCommand(words=("shapeplan", "guard", "--plan", plan_path, "--", *command.words),
                      notes=(why, *command.notes))


def guarded_script(plan_path: str | None, command: Sequence[str]) -> TrlCommand:
    """The command that trains a script's run (script mode) under the guard: `shapeplan guard --plan PLAN --
    COMMAND`. The guard applies the compiler settings the warm-up used (Python-only ones among them, which no
    `export` carries) and checks every shape against the plan."""
    plan = ("--plan", plan_path) if plan_path is not None else ()
    notes = () if plan_path is not None else (
        "add --plan PLAN (written by `shapeplan analyze -o PLAN -- " + shlex.join(command) + "`) to check every shape "
        "the run meets against the plan",)
    return TrlCommand(words=("shapeplan", "guard", *plan, "--", *command), notes=notes)


_AGENTIC_OPTIONS = ("tools", "environment_factory", "rollout_func", "pad_tool_turns", "no_pad_tool_turns", "pin_cache",
                    "no_pin_cache")


def trl_options(pairs: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """The `--name value` pairs `trl` takes: shapeplan's options for Python objects, and for what the user's script
    does with them (`pad_tool_turns`, `pin_cache`), left out."""
    return [(name, value) for name, value in pairs if name not in _AGENTIC_OPTIONS]


def _without_agentic_options(argv: Sequence[str]) -> list[str]:
    """`argv` without shapeplan's options for Python objects (`trl` has none of them), each with its values."""
    out: list[str] = []
    skipping = False
    for token in argv:
        if token.startswith("--"):
            skipping = token[2:].split("=", 1)[0].replace("-", "_") in _AGENTIC_OPTIONS
            if skipping:
                continue
        elif skipping:
            continue
        out.append(token)
    return out


def with_options(argv: Sequence[str], pairs: Sequence[tuple[str, str]], *, in_place: bool = False) -> list[str]:
    """`argv` with each `--name value` of `pairs` replacing any given value (`--name value`, `--name=value` or a bare
    boolean `--name`): appended, or (`in_place`) where the first one was; TRL's parser lets the command line override
    a `--config` file."""
    values = dict(pairs)
    out: list[str] = []
    placed: set[str] = set()
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        name = token[2:].split("=", 1)[0].replace("-", "_") if token.startswith("--") else None
        if name in values:
            has_value = "=" not in token and i + 1 < len(tokens) and not tokens[i + 1].startswith("--")
            i += 2 if has_value else 1
            if in_place and name not in placed:
                out += [f"--{name}", values[name]]
                placed.add(name)
            continue
        out.append(token)
        i += 1
    return out + [token for name, value in pairs if name not in placed for token in (f"--{name}", value)]


def dataset_folder(splits: Mapping[str, str]) -> Path:
    """A dataset folder whose README.md names each local file (absolute) as the split it is keyed by."""
    import yaml

    files = [{"split": split, "path": str(Path(path).resolve())} for split, path in splits.items()]
    text = "---\n" + yaml.safe_dump({"configs": [{"config_name": "default", "data_files": files}]},
                                    sort_keys=False) + "---\n"
    folder = cache_root() / "datasets" / hashlib.sha256(text.encode()).hexdigest()[:16]
    card = folder / "README.md"
    try:
        if not card.is_file() or card.read_text(encoding="utf-8") != text:
            folder.mkdir(parents=True, exist_ok=True)
            write_atomic(card, text)
    except OSError as exc:
        raise CacheError(f"cannot write the dataset folder {folder} for the `trl` command ({exc.strerror}); set "
                         "SHAPEPLAN_CACHE_DIR to a writable folder") from exc
    return folder
