"""LoRA: train low-rank adapters on a frozen base model, through peft (an extra: `pip install -e '.[lora]'`).

`add_adapters` injects peft's LoRA layers into the model in place (no PeftModel wrapper, so
the model keeps its class, its `base_model` and its head, which policies.logprobs calls) and
freezes everything else. Which parameters train is then the model's own fact,
`requires_grad`, which the optimizer and the weight channel read: only the adapters are
trained and sent to generators, the base stays the warm start on every process.

The adapters' initial values are drawn from their own seed (the global torch RNG is left
untouched), so every process that builds the same model gets the same adapters; peft
starts B at zero, so an adapted model first computes exactly what its base does.

A checkpoint holds the model with the adapters merged in (save_pretrained: any tool loads
the trained policy) plus the adapter tensors alone (`ADAPTER_FILE`), from which a run
resumes on top of the same base.
"""

from __future__ import annotations

import copy
import importlib.util
import warnings
from pathlib import Path

import torch

from policies.spec import LoraSpec

ADAPTER_FILE = "adapter.safetensors"
ADAPTER = "default"  # peft's adapter name; one adapter per model


def peft_missing() -> str | None:
    """Why LoRA cannot run here, or None."""
    if importlib.util.find_spec("peft") is None:
        return "LoRA needs the peft package, which is not installed: pip install -c constraints.txt -e '.[lora]'"
    return None


def add_adapters(model: torch.nn.Module, spec: LoraSpec, seed: int) -> torch.nn.Module:
    """Inject LoRA adapters into ``model`` (in place) and freeze everything else; returns ``model``."""
    from peft import LoraConfig, inject_adapter_in_model  # the optional extra: imported only when asked for

    # dropout would make the learner's log-probs differ from the generator's sampling distribution
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                        target_modules=list(spec.targets) or None)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        torch.manual_seed(seed)
        warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False")  # GPT-2's Conv1D: peft adapts
        try:
            inject_adapter_in_model(config, model, adapter_name=ADAPTER)
        except ValueError as exc:  # peft names targets it cannot find, or a family it has no default for
            raise ValueError(f"lora: {exc}") from None
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return model


def lora_problem(model: torch.nn.Module, spec: LoraSpec) -> str | None:
    """Why ``spec`` cannot adapt ``model`` (a ``policies.models.skeleton`` is enough), or None."""
    try:
        add_adapters(model, spec, seed=0)
    except ValueError as exc:
        return str(exc).removeprefix("lora: ")
    return None


def has_adapters(model: torch.nn.Module) -> bool:
    return any(".lora_" in name for name, _ in model.named_parameters())


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors by name (what a checkpoint needs besides the base)."""
    return {name: p.detach().cpu().contiguous() for name, p in model.named_parameters() if ".lora_" in name}


def adapter_bytes(model: torch.nn.Module) -> bytes:
    from safetensors.torch import save

    return save(adapter_state(model))


PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")
# where a checkpoint keeps them: beside the merged model, transformers' from_pretrained would read the folder as
# an adapter over the base (it looks for adapter_config.json), not as the merged policy
PEFT_DIR = "adapter"


def peft_files(model: torch.nn.Module, base: str) -> dict[str, bytes]:
    """The adapters as PEFT writes them (``PEFT_FILES``), for ``PeftModel.from_pretrained(the base at base, dir)``:
    peft's own state-dict naming under ``base_model.model.``, and its config naming the base model."""
    import tempfile

    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save

    state = get_peft_model_state_dict(model, adapter_name=ADAPTER)
    config = copy.copy(model.peft_config[ADAPTER])
    config.base_model_name_or_path, config.task_type = base, "CAUSAL_LM"
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)  # peft's serialisation of its config (sets, enums)
        written = (Path(tmp) / PEFT_FILES[0]).read_bytes()
    return {PEFT_FILES[0]: written,
            PEFT_FILES[1]: save({f"base_model.model.{k}": v.detach().cpu().contiguous() for k, v in state.items()})}


def load_adapters(model: torch.nn.Module, step_dir: str | Path) -> None:
    """Copy a checkpoint's adapter tensors into ``model``'s adapters (same spec); every one must match."""
    from safetensors.torch import load_file

    saved = load_file(Path(step_dir) / ADAPTER_FILE)
    mine = dict(model.named_parameters())
    wanted = {name for name in mine if ".lora_" in name}
    if set(saved) != wanted:
        raise ValueError(f"{step_dir}/{ADAPTER_FILE}: its adapters do not match the model's lora settings "
                         f"({len(saved)} tensors saved, {len(wanted)} expected)")
    with torch.no_grad():
        for name, tensor in saved.items():
            mine[name].copy_(tensor)


def merged(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with its adapters merged into the base weights, as a plain model of its class."""
    from peft.tuners.lora import LoraLayer

    plain = copy.deepcopy(model)
    for name, layer in list(plain.named_modules()):
        if isinstance(layer, LoraLayer):
            layer.merge()
            parent, _, child = name.rpartition(".")
            setattr(plain.get_submodule(parent), child, layer.get_base_layer())
    plain.__dict__.pop("peft_config", None)  # peft's note on the model: the copy no longer has adapters
    return plain
