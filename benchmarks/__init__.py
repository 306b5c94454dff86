

def emit(result: dict, out) -> int:
    """A benchmark's end: its JSON, indented, to ``out`` (a path, or None) and on one line as the last printed."""
    import json
    from pathlib import Path

    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


def git_commit() -> str:
    """The checkout's commit, short, with "+local-changes" when tracked files differ from it: what a result names."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True).stdout.strip()
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return git("rev-parse", "--short", "HEAD") + ("+local-changes" if dirty else "")
