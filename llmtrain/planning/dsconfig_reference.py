"""Regenerate ds_configs/ (`make ds-configs`)."""

import json
from pathlib import Path

from llmtrain.planning.dsconfig import reference_configs

if __name__ == "__main__":
    out = Path(__file__).resolve().parents[2] / "ds_configs"
    out.mkdir(exist_ok=True)
    for name, ds in reference_configs().items():
        (out / f"{name}.json").write_text(json.dumps(ds, indent=2) + "\n")
        print(f"wrote ds_configs/{name}.json")
