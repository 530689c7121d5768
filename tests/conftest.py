import os
import sys
from pathlib import Path

# DeepSpeed picks its accelerator at import; tests run on CPU unless a GPU test asks otherwise.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))
