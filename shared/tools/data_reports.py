"""The data reports of docs/data.md: each built-in task, and a user's file, as `--preflight` prints and saves them.

    python -m shared.tools.data_reports           # print the section
    python -m shared.tools.data_reports --write   # replace it in docs/data.md (between the data-report markers)

Machine-independent: the built-in data and the user file below are generated, the same on every machine (written on
2 CPU cores, torch 2.13.0+cpu)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "data.md"
START, END = "<!-- data-report -->", "<!-- /data-report -->"


def _user_file(tmp: Path) -> Path:
    """A ';'-separated CSV as Excel writes it in many locales, string labels, one blank line."""
    from shared.tasks.text_classification import sentiment_dataset

    d = sentiment_dataset(60, seed=7)
    rows = "".join(f"{t};{'pos' if y else 'neg'}\n" for t, y in zip(d["text"], d["label"], strict=True))
    path = tmp / "reviews.csv"
    path.write_text("review;sentiment\n" + rows)
    return path


RUNS = {  # title: argv (relative paths under the temporary folder as {tmp})
    "text-classification, built-in data": ["--task", "text-classification"],
    "causal-lm, built-in data": ["--task", "causal-lm"],
    "image-classification, built-in data": ["--task", "image-classification"],
    "a user's file: reviews.csv, ';'-separated, string labels": ["--train_file", "{file}",
                                                                  "--label_column", "sentiment"],
}


def reports() -> dict[str, dict]:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        file = _user_file(Path(tmp))
        for title, argv in RUNS.items():
            run = Path(tmp) / f"run{len(out)}"
            cmd = [sys.executable, str(ROOT / "recipes" / "baseline.py"), "--preflight", "--report_to", "none",
                   "--output_dir", str(run), *[a.format(file=file) for a in argv]]
            subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
            report = json.loads((run / "data_report.json").read_text())
            report["source"] = report["source"].replace(str(file), "reviews.csv")
            out[title] = report
    return out


def section() -> str:
    parts = [START, ""]
    for title, report in reports().items():
        # one line per field: the report as a reader scans it
        shown = "{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}"
                                    for k, v in report.items()) + "\n}"
        parts += [f"**{title}** (`data_report.json`):", "", "```json", shown, "```", ""]
    return "\n".join(parts + [END])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true")
    args = p.parse_args()
    text = section()
    if not args.write:
        print(text)
        return
    doc = DOC.read_text()
    head, rest = doc.split(START, 1)
    DOC.write_text(head + text + rest.split(END, 1)[1])


if __name__ == "__main__":
    main()
