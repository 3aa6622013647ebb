"""The fast lengths equal TRL's own `SFTTrainer._prepare_dataset`, row by row, on every row format it handles."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from shapeplan.adapters import lengths
from shapeplan.adapters.sft import _bare_trainer, prepare_rows
from shapeplan.plan.rows import Rows
from tests.conftest import CAPYBARA, TINY_MODEL, TLDR

BOS = "<|endoftext|>"  # a special token of the tiny tokenizer, used as BOS by the variants below
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Small datasets in each row format TRL prepares differently."""
    root = tmp_path_factory.mktemp("lengths-data")
    chats = _read(CAPYBARA)[:40]
    eos = "<|im_end|>"
    return {
        "messages": CAPYBARA,
        "messages-tools-kwargs": _jsonl(root / "tools.jsonl", [
            {"messages": row["messages"], "tools": json.dumps([TOOL]) if i % 2 else "null",
             "chat_template_kwargs": {"enable_thinking": bool(i % 3)}}
            for i, row in enumerate(chats)]),
        "text": _jsonl(root / "text.jsonl", [
            {"text": " ".join(m["content"] for m in row["messages"]) + (eos if i % 3 == 0 else "")}
            for i, row in enumerate(chats)]),
        "prompt-completion": TLDR,
        "conversational-prompt-completion": _jsonl(root / "conv-pc.jsonl", [
            {"prompt": row["messages"][:-1], "completion": row["messages"][-1:],
             "chat_template_kwargs": {"enable_thinking": i % 2 == 0}}
            for i, row in enumerate(chats)]),
        "conversational-prompt-completion-hidden": _jsonl(root / "conv-pc-hidden.jsonl", [
            {"prompt": row["messages"][:-1], "completion": row["messages"][-1:],
             "chat_template_kwargs": {"hide_answer": i % 4 == 0}}
            for i, row in enumerate(chats)]),
        "prompt-completion-eos-in-prompt": _jsonl(root / "pc-eos.jsonl", [
            {"prompt": row["prompt"] + (eos if i % 2 else ""), "completion": row["completion"]}
            for i, row in enumerate(_read(TLDR))]),
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny tokenizer, one whose chat template starts with BOS, one whose post-processor adds BOS to text."""
    root = tmp_path_factory.mktemp("lengths-models")
    template_bos = root / "template-bos"
    shutil.copytree(TINY_MODEL, template_bos)
    template = template_bos / "chat_template.jinja"
    template.write_text("{{- '" + BOS + "' }}\n" + template.read_text())
    processor_bos = root / "processor-bos"
    shutil.copytree(TINY_MODEL, processor_bos)
    config = json.loads((processor_bos / "tokenizer.json").read_text())
    bos_id = next(t["id"] for t in config["added_tokens"] if t["content"] == BOS)
    config["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {BOS: {"id": BOS, "ids": [bos_id], "tokens": [BOS]}},
    }
    (processor_bos / "tokenizer.json").write_text(json.dumps(config))
    # With hide_answer, the completion renders to nothing and the generation prompt outlasts it: the full ids are a
    # prefix of the prompt's, no token is trainable, and TRL drops the row however long max_length is.
    hide_answer = root / "hide-answer"
    shutil.copytree(TINY_MODEL, hide_answer)
    (hide_answer / "chat_template.jinja").write_text(
        "{%- for m in messages %}{%- if m.role != 'assistant' or not hide_answer %}"
        "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    return {"plain": TINY_MODEL, "template-bos": template_bos, "processor-bos": processor_bos,
            "hide-answer": hide_answer}


def _load(data: dict[str, Path], models: dict[str, Path], dataset: str, model: str) -> tuple[Any, Any]:
    from datasets import load_dataset
    from transformers import AutoTokenizer

    return (load_dataset("json", data_files=str(data[dataset]), split="train"),
            AutoTokenizer.from_pretrained(models[model]))


def _config(tmp_path: Path, **options: Any) -> Any:
    from trl import SFTConfig

    return SFTConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **options)


def trl_rows(dataset: Any, tokenizer: Any, config: Any, *, packing: bool) -> tuple[Rows, int]:
    """What TRL's own preparation leaves: each prepared row's length (and packed documents), and rows dropped."""
    import pyarrow.compute as pc

    trainer = _bare_trainer(tokenizer, config, dataset[0])
    prepared = trainer._prepare_dataset(dataset, tokenizer, config, packing, None, "train")
    table = prepared.with_format("arrow")[:]
    documents = None
    if "seq_lengths" in table.column_names:
        documents = tuple(tuple(d) for d in table.column("seq_lengths").to_pylist())
    rows = Rows(lengths=tuple(pc.list_value_length(table.column("input_ids")).to_pylist()), documents=documents)
    return rows, 0 if packing else len(dataset) - len(prepared)


def fast_rows(dataset: Any, tokenizer: Any, config: Any, *, packing: bool, workers: int = 1) -> tuple[Rows, int]:
    assert lengths.fast_path_refusal(dataset, tokenizer, config) is None
    trainer = _bare_trainer(tokenizer, config, dataset[0])
    return lengths.fast_prepared_rows(trainer, dataset, tokenizer, config, packing=packing, name="train",
                                      workers=workers)


# (dataset, tokenizer, SFTConfig options); small max_length values truncate most rows, and with a completion-only
# loss they leave rows whose prompt fills the kept window, which TRL drops.
CASES = {
    "messages": ("messages", "plain", {}),
    "messages-truncated": ("messages", "plain", {"max_length": 96}),
    "messages-template-bos": ("messages", "template-bos", {"max_length": 200}),
    "messages-tools-kwargs": ("messages-tools-kwargs", "plain", {"max_length": None}),
    "messages-tools-truncated": ("messages-tools-kwargs", "template-bos", {"max_length": 150}),
    "text-eos": ("text", "plain", {"max_length": None}),
    "text-processor-bos": ("text", "processor-bos", {"max_length": 64}),
    "text-keep-end": ("text", "processor-bos", {"max_length": 64, "truncation_mode": "keep_end"}),
    "prompt-completion": ("prompt-completion", "plain", {"max_length": None}),
    "prompt-completion-drops": ("prompt-completion", "processor-bos", {"max_length": 120}),
    "prompt-completion-keep-end": ("prompt-completion", "plain", {"max_length": 120, "truncation_mode": "keep_end"}),
    "prompt-completion-full-loss": ("prompt-completion", "plain", {"max_length": 120, "completion_only_loss": False}),
    "conversational-prompt-completion": ("conversational-prompt-completion", "plain", {"max_length": None}),
    "conversational-prompt-completion-drops": ("conversational-prompt-completion", "template-bos",
                                               {"max_length": 100}),
    "conversational-prompt-completion-hidden": ("conversational-prompt-completion-hidden", "hide-answer",
                                                {"max_length": 4096}),
    "prompt-completion-eos-in-prompt": ("prompt-completion-eos-in-prompt", "processor-bos", {"max_length": 120}),
    "prompt-completion-eos-not-added": ("prompt-completion", "plain", {"max_length": 120, "eos_token": "Ġthe"}),
    "packing-bfd": ("messages", "plain", {"max_length": 256, "packing": True}),
    "packing-bfd-split-shuffled": ("prompt-completion", "plain", {"max_length": 128, "packing": True,
                                                                  "packing_strategy": "bfd_split",
                                                                  "shuffle_dataset": True}),
    "packing-wrapped": ("text", "processor-bos", {"max_length": 100, "packing": True, "packing_strategy": "wrapped"}),
    "shuffled-truncated": ("conversational-prompt-completion", "plain", {"max_length": 100, "shuffle_dataset": True,
                                                                          "seed": 7}),
}
# Cases whose fixture must make TRL drop rows, so the drop rule is exercised rather than assumed.
DROPPING = {"prompt-completion-drops", "conversational-prompt-completion-drops", "shuffled-truncated",
            "conversational-prompt-completion-hidden", "prompt-completion-eos-in-prompt",
            "prompt-completion-eos-not-added"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fast_lengths_equal_trl_row_by_row(case: str, data: dict[str, Path], models: dict[str, Path],
                                           tmp_path: Path) -> None:
    dataset_name, model, options = CASES[case]
    dataset, tokenizer = _load(data, models, dataset_name, model)
    config = _config(tmp_path, **options)
    expected = trl_rows(dataset, tokenizer, config, packing=config.packing)
    assert (expected[1] > 0) == (case in DROPPING)
    assert fast_rows(dataset, tokenizer, config, packing=config.packing) == expected


def test_bos_variants_add_bos(data: dict[str, Path], models: dict[str, Path]) -> None:
    """The BOS fixtures do what their names say, so the cases above cover both ways BOS is added."""
    _, template_bos = _load(data, models, "messages", "template-bos")
    _, processor_bos = _load(data, models, "messages", "processor-bos")
    bos_id = template_bos.convert_tokens_to_ids(BOS)
    assert template_bos.apply_chat_template([{"role": "user", "content": "hi"}])["input_ids"][0] == bos_id
    assert processor_bos("hi")["input_ids"][0] == bos_id


@pytest.mark.parametrize(("model", "eos", "special", "expected"), [
    ("plain", "<|im_end|>", True, (2, 0)),  # in the BPE vocabulary too, but no merge makes it
    ("processor-bos", BOS, True, (0, 1)),  # the post-processor adds one
    ("processor-bos", BOS, False, (0, 0)),
    ("plain", "Ġthe", True, None),  # an ordinary token: any text can make it
])
def test_countable_eos(model: str, eos: str, special: bool, expected: tuple[int, int] | None,
                       data: dict[str, Path], models: dict[str, Path]) -> None:
    _, tokenizer = _load(data, models, "messages", model)
    tokenizer.eos_token = eos
    assert lengths._countable_eos(tokenizer, eos, special=special) == expected


def test_worker_processes_give_the_same_lengths(data: dict[str, Path], models: dict[str, Path], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lengths, "CHUNK_ROWS", 7)  # several chunks over two workers, the last one short
    dataset, tokenizer = _load(data, models, "conversational-prompt-completion", "template-bos")
    config = _config(tmp_path, max_length=100)
    expected = trl_rows(dataset, tokenizer, config, packing=False)
    assert fast_rows(dataset, tokenizer, config, packing=False, workers=2) == expected


def test_vision_data_is_refused(data: dict[str, Path], models: dict[str, Path], tmp_path: Path) -> None:
    dataset, tokenizer = _load(data, models, "messages", "plain")
    dataset = dataset.add_column("images", [[] for _ in range(len(dataset))])
    assert lengths.fast_path_refusal(dataset, tokenizer, _config(tmp_path)) == "vision data"


@pytest.mark.parametrize(("case", "reason"), [("assistant-only-loss", "assistant_only_loss masks"),
                                              ("tokenized", "dataset already tokenized")])
def test_refused_datasets_take_trls_path(case: str, reason: str, data: dict[str, Path], models: dict[str, Path],
                                         tmp_path: Path) -> None:
    from datasets import Dataset

    dataset, tokenizer = _load(data, models, "messages", "plain")
    if case == "tokenized":
        dataset = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], list(range(9))]})
        config = _config(tmp_path, max_length=4)
    else:
        config = _config(tmp_path, max_length=60, assistant_only_loss=True)
    assert lengths.fast_path_refusal(dataset, tokenizer, config) == reason
    expected = trl_rows(dataset, tokenizer, config, packing=False)
    assert prepare_rows(dataset, tokenizer, config, packing=False, name="train", use_cache=False) == expected


@pytest.mark.parametrize("kind", ["messages", "conversational-prompt-completion"])
def test_two_threads_in_one_process_give_the_same_lengths(kind: str, data: dict[str, Path], models: dict[str, Path],
                                                          tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One thread renders the chunks while two others tokenize the ones rendered before (the default on 2 cores):
    the lengths are TRL's, in order, and the tokenizer's own parallelism setting is left as it was."""
    monkeypatch.setattr(lengths, "CHUNK_ROWS", 7)  # several chunks, the last one short
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    dataset, tokenizer = _load(data, models, kind, "template-bos")
    config = _config(tmp_path, max_length=100)
    expected = trl_rows(dataset, tokenizer, config, packing=False)
    assert fast_rows(dataset, tokenizer, config, packing=False, workers=1) == expected
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"


ROW_FORMATS = [
    {"messages": [{"role": "user", "content": "hi"}]}, {"messages": ["hi"]}, {"messages": [{"content": "hi"}]},
    {"messages": "hi"}, {"messages": []}, {"text": "hi"}, {"prompt": "a", "completion": "b"},
    {"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": "assistant", "content": "b"}]},
    {"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]},  # one key decides, as TRL picks it
    {"chosen": [{"role": "user", "content": "a"}], "rejected": "b"},
    {"conversations": [{"from": "human", "value": "hi"}]}, {"conversations": [{"role": "user", "content": "hi"}]},
    {"conversations": [{"from": "human"}]}, {"conversations": []}, {"conversations": None},
]


@pytest.mark.parametrize("example", ROW_FORMATS, ids=[json.dumps(e)[:48] for e in ROW_FORMATS])
def test_row_format_checks_are_trls(example: dict[str, Any]) -> None:
    from trl.data_utils import is_conversational, is_conversational_from_value

    for ours, trls in ((lengths.is_conversational, is_conversational),
                       (lengths.is_conversational_from_value, is_conversational_from_value)):
        try:
            expected: Any = trls(example)
        except IndexError as exc:  # an empty list: TRL reads its first message
            expected = type(exc)
        if expected is IndexError:
            with pytest.raises(IndexError):
                ours(example)
        else:
            assert ours(example) is expected
