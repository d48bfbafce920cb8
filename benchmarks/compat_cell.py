"""Run one recipe as `accelerate launch` would, and record how it ended: the compatibility sweep's probe.

    accelerate launch [launch args] benchmarks/compat_cell.py recipes/combined.py [recipe args] --output_dir DIR

The recipe runs unchanged as __main__. A SystemExit with a message (a recipe's refusal before training) is written to
DIR/refused_rank<r>.txt, any other exception to DIR/broken_rank<r>.txt; both are re-raised, so the launch fails as
it would without this probe.
"""

import json
import os
import runpy
import sys
import traceback
from pathlib import Path


def refusal_message(e: SystemExit) -> str:
    """The refusal's words. Under a launcher the recipe's @entrypoint (shared/core/launch.py) writes them to torch
    elastic's error file and exits with code 1."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not isinstance(e.code, str) and error_file and Path(error_file).exists():
        return json.loads(Path(error_file).read_text()).get("message", str(e.code))
    return str(e.code)


def main() -> None:
    recipe, argv = sys.argv[1], sys.argv[2:]
    out = Path(argv[argv.index("--output_dir") + 1])
    rank = os.environ.get("RANK", "0")
    sys.argv = [recipe, *argv]
    try:
        runpy.run_path(recipe, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            out.mkdir(parents=True, exist_ok=True)
            (out / f"refused_rank{rank}.txt").write_text(refusal_message(e))
        raise
    except BaseException:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"broken_rank{rank}.txt").write_text(traceback.format_exc())
        raise


if __name__ == "__main__":
    main()
