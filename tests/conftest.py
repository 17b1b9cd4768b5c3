import os
import sys

# Tests import helpers as `tests.helpers...` from the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("WANDB_MODE", "disabled")
