"""Run ``gspo-train`` in this process once per (recipe, loss variant): the recipe as shipped, its
loss switched by the one override ``--loss.variant=V``, shrunk by the given overrides.

    python tests/helpers/switch_losses.py OUT_DIR RECIPE[::OVERRIDE,...] ... -- VARIANT ... -- OVERRIDE ...

Each run writes ``OUT_DIR/<recipe stem>/<variant>/``; the first failing run ends this process
with its exit code and a line naming the recipe and the variant. One process for all the runs:
the interpreter and the libraries are paid for once (``gspo_megatron.cli.main`` restores what it
changes, so runs in one process do not see each other).
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    from gspo_megatron.cli import main as gspo_train

    out_dir, rest = argv[0], argv[1:]
    split = [i for i, a in enumerate(rest) if a == "--"]
    recipes, variants, common = rest[:split[0]], rest[split[0] + 1:split[1]], rest[split[1] + 1:]
    for item in recipes:
        recipe, _, extra = item.partition("::")
        stem = os.path.splitext(os.path.basename(recipe))[0]
        for variant in variants:
            run_dir = os.path.join(out_dir, stem, variant)
            code = gspo_train(["--config", recipe, f"--loss.variant={variant}",
                               f"--logging.run_dir={run_dir}", *common,
                               *[o for o in extra.split(",") if o]])
            if code != 0:
                print(f"switch_losses: {stem} with --loss.variant={variant}: exit {code}",
                      file=sys.stderr)
                return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
