"""What a PEFT (LoRA) run changes, in one place: `trl <method> --use_peft` wraps the model in a `PeftModel`.

- transformers runs the model inside the wrapper: `PeftModel.generate` calls the inner model's own `generate` (which
  keeps its static cache length on itself, `_previous_max_cache_length`), and a forward reaches the inner model's
  `__call__` through the tuner;
- the reference forwards of DPO, KTO, GRPO and RLOO (`beta` > 0) run the policy itself with its adapters disabled
  (TRL's `use_adapter`, or the adapter named "ref" when the run retrains one), not a reference model;
- the adapter settings TRL reads from its `ModelConfig` (`get_peft_config`) decide the compiled graphs.
"""

from __future__ import annotations

from typing import Any

# ModelConfig's fields that `trl.get_peft_config` turns into the LoraConfig (with `use_peft` itself)
_PEFT_FIELDS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_parameters",
                "lora_modules_to_save", "lora_task_type", "use_rslora", "use_dora")


def is_peft_model(model: Any) -> bool:
    return hasattr(model, "get_base_model") and hasattr(model, "peft_config")


def inner_model(model: Any) -> Any:
    """The transformers model that runs: inside a `PeftModel`, its base model; any other model itself."""
    return model.get_base_model() if is_peft_model(model) else model


def adapters_off(model: Any) -> bool:
    """Whether a `PeftModel` runs as the reference model now: adapters disabled, or the "ref" adapter active."""
    if not is_peft_model(model):
        return False
    return bool(getattr(model, "_adapters_disabled", False)) or "ref" in (getattr(model, "active_adapters", None)
                                                                          or ())


def peft_settings(model_args: Any) -> dict[str, Any] | None:
    """The run's PEFT settings as `trl.get_peft_config` reads them from TRL's ModelConfig; None without --use_peft."""
    if not getattr(model_args, "use_peft", False):
        return None
    return {name.removeprefix("lora_"): getattr(model_args, name, None) for name in _PEFT_FIELDS}


def describe(settings: dict[str, Any] | None) -> str:
    """One phrase for a run's PEFT settings: "no PEFT" or "LoRA r=8, alpha=16, targets all-linear, ..."."""
    if settings is None:
        return "no PEFT (full fine-tuning)"
    targets = settings.get("target_modules")
    shown = {"r": settings.get("r"), "alpha": settings.get("alpha"), "dropout": settings.get("dropout"),
             "targets": ",".join(targets) if isinstance(targets, list) else targets,
             **{k: v for k, v in settings.items()
                if k not in ("r", "alpha", "dropout", "target_modules") and v not in (None, False, "CAUSAL_LM")}}
    return "LoRA " + ", ".join(f"{k}={v}" for k, v in shown.items())
