"""Writing result JSON (benchmarks, parity runs): one way, creating parent folders."""

import json
import os


def write_json(path: str, doc) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {path}")
