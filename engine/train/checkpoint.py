"""Resumable checkpoints of a model's learner: ``checkpoints/<model>/step-NNNNNN/`` and ``latest``.

A step directory is a save_pretrained model (safetensors, with the tokenizer) that any
tool loads, plus what resuming needs: ``trainer.pt`` (AdamW state, the sampling RNG) and
``state.json`` (step = weight version, the prompt ids this learner has trained on, its
running totals). With LoRA the model is saved with its adapters merged in, and the
adapters alone (``policies.lora.ADAPTER_FILE``) are what a resume puts back on the warm
start. It is written whole into a hidden temporary directory, fsync'd, renamed
into place, and only then does the ``latest`` symlink move to it (itself replaced by a
rename), so a crash at any moment leaves ``latest`` naming a complete checkpoint. The
newest ``run.keep_checkpoints`` step directories are kept.

Which experience the learner consumed is recorded by prompt id: a resumed run replays
every logged experience of the other prompts (``engine.train.ingest``), and hands out
again whatever was never logged (``engine.schedule.dispatch``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

LATEST = "latest"
STATE, TRAINER = "state.json", "trainer.pt"
# what only a resume reads (with policies.lora.ADAPTER_FILE, named here so that the launcher needs no torch)
RESUME_ONLY = (STATE, TRAINER, "adapter.safetensors")


def model_dir(run_dir: str | os.PathLike, model: str) -> Path:
    return Path(run_dir) / "checkpoints" / model


def save(run_dir: str | os.PathLike, core, keep: int) -> Path:
    """Checkpoint ``core`` (an ``engine.roles.learner_core.LearnerCore``); returns the step directory."""
    import torch  # here, not above: the coordinator reads checkpoints' paths and state without torch

    from policies.lora import ADAPTER_FILE, PEFT_DIR, adapter_bytes, has_adapters, merged, peft_files
    from policies.models import save_policy

    root, version = model_dir(run_dir, core.model_name), core.state.version
    final = root / f"step-{version:06d}"
    if (root / LATEST).resolve() == final.resolve() and final.is_dir():
        return final  # this step is saved already (a stop right after a periodic checkpoint)
    state = {"step": version, "consumed": sorted(core.ingest.consumed), "totals": core.totals}
    tmp = root / f".step-{version:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    module, files = core.module, {STATE: json.dumps(state).encode()}
    if has_adapters(module):  # LoRA: the trained policy for any tool, the adapters to resume from, and for PEFT
        peft = peft_files(module, str(core.worker.plan.warm_checkpoints[core.model_name]))
        files.update({f"{PEFT_DIR}/{name}": data for name, data in peft.items()})
        module, files[ADAPTER_FILE] = merged(module), adapter_bytes(module)
    save_policy(module, core.tok, tmp, files)
    # streamed into its file: serialised into memory first (BytesIO, then its bytes) the optimizer state was held
    # twice more at the save, 1.1 GB for SmolLM2's AdamW and the run's peak (benchmarks.memory)
    torch.save({"optimizer": core.state.optimizer.state_dict(), "rng": core.state.rng.get_state()}, tmp / TRAINER)
    _fsync_tree(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    link = root / f".{LATEST}.tmp"
    link.unlink(missing_ok=True)
    os.symlink(final.name, link)
    os.replace(link, root / LATEST)
    _fsync(root)
    _prune(root, keep)
    return final


FINAL = "final"  # RUN_DIR/final/<model>: the newest checkpoint's model, for from_pretrained


def export_final(run_dir: str | os.PathLike, model: str) -> Path | None:
    """``RUN_DIR/final/<model>/``: the model files of the newest checkpoint (hard links, no copy), without what
    only a resume reads; a directory ``AutoModelForCausalLM.from_pretrained`` loads (for LoRA, the merged model,
    and in ``adapter/`` PEFT's files for ``PeftModel.from_pretrained`` over the warm start).
    None where the model has no checkpoint."""
    step = latest(run_dir, model)
    if step is None:
        return None
    out = Path(run_dir) / FINAL / model
    tmp = out.with_name(f".{model}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in step.rglob("*"):
        if f.is_file() and f.name not in RESUME_ONLY:
            target = tmp / f.relative_to(step)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(f, target)
            except OSError:  # another file system, or links refused: a copy
                shutil.copy2(f, target)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    return out


def latest(run_dir: str | os.PathLike, model: str) -> Path | None:
    """The newest complete checkpoint of ``model`` in the run, or None."""
    link = model_dir(run_dir, model) / LATEST
    return link.resolve() if link.is_symlink() and (link / STATE).is_file() else None


def read_state(step_dir: Path) -> dict:
    return json.loads((step_dir / STATE).read_text())


def restore(step_dir: Path, state, totals: dict, device: torch.device) -> set[int]:
    """Load the trainer state into ``state`` (a ``TrainState``) and ``totals``; returns the consumed prompts."""
    import torch

    saved = read_state(step_dir)
    trainer = torch.load(step_dir / TRAINER, map_location=device, weights_only=True)
    state.optimizer.load_state_dict(trainer["optimizer"])
    state.rng.set_state(trainer["rng"].cpu())
    state.version = saved["step"]
    totals.update(saved["totals"])
    return set(saved["consumed"])


def _prune(root: Path, keep: int) -> None:
    steps = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_tree(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            _fsync(p)
    _fsync(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
