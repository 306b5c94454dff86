

def emit(result: dict, out) -> int:
    """A benchmark's end: its JSON, indented, to ``out`` (a path, or None) and on one line as the last printed."""
    import json
    from pathlib import Path

    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0
