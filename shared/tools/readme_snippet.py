"""The README's code snippet, kept equal to recipes/baseline.py's own lines.

    python -m shared.tools.readme_snippet           # exit 1 and say so if the README's snippet is stale
    python -m shared.tools.readme_snippet --write   # rewrite it from recipes/baseline.py

The snippet is the ```python block right after the line `<!-- snippet: recipes/baseline.py -->` in README.md. It is
baseline.py's lines from `args = parse_args(` through `return finish(`, dedented; tests/test_docs.py holds the
README's block to be a contiguous run of baseline.py's lines.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SOURCE = ROOT / "recipes" / "baseline.py"
MARKER = "<!-- snippet: recipes/baseline.py -->"
FIRST, LAST = "args = parse_args(", "return finish("


def excerpt(source: str | None = None) -> str:
    """baseline.py's lines from FIRST through LAST, dedented."""
    lines = (SOURCE.read_text() if source is None else source).splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(FIRST))
    end = next(i for i in range(start, len(lines)) if lines[i].lstrip().startswith(LAST))
    return textwrap.dedent("\n".join(lines[start:end + 1]))


def span(readme: str) -> tuple[int, int]:
    """Character offsets of the snippet's code (between the ```python line and the closing ```)."""
    at = readme.index(MARKER)
    fence = readme.index("```python\n", at)
    assert readme[at + len(MARKER):fence].strip() == "", "the ```python block must follow the snippet marker"
    start = fence + len("```python\n")
    return start, readme.index("\n```", start - 1) + 1


def snippet(readme: str | None = None) -> str:
    readme = README.read_text() if readme is None else readme
    start, end = span(readme)
    return readme[start:end].rstrip("\n")


def refreshed(readme: str, source: str | None = None) -> str:
    start, end = span(readme)
    return readme[:start] + excerpt(source) + "\n" + readme[end:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true", help="Rewrite README.md's snippet from recipes/baseline.py.")
    args = p.parse_args(argv)
    text = README.read_text()
    new = refreshed(text)
    if args.write:
        if new != text:
            README.write_text(new)
        print(f"README.md's snippet: {len(excerpt().splitlines())} lines of recipes/baseline.py")
        return 0
    if new != text:
        print("README.md's snippet differs from recipes/baseline.py: python -m shared.tools.readme_snippet --write")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
