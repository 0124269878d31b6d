"""The report's tests' shared step: write cells as a run's JSON, merge it as compare.py --merge does."""
import json

import compare


def merged(tmp_path, data: dict) -> tuple[int, dict]:
    """compare.py --merge of `data` (a run's JSON): its exit status and the JSON it writes."""
    path = tmp_path / "cells.json"
    path.write_text(json.dumps(data))
    status = compare.main(["--merge", str(path), "--json", str(tmp_path / "out.json")])
    return status, json.loads((tmp_path / "out.json").read_text())
