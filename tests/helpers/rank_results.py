"""Worker results per rank, as the distributed tests read them."""

from __future__ import annotations

import json
import os


def write_rank_json(out_dir: str, rank: int, result: dict) -> None:
    """A worker's result as ``{out_dir}/rank{rank}.json`` (what the tests load per rank)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
