"""Loading trusts nothing: torch.load only with weights_only=True, remote code only when the user passes the flag."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for d in ("recipes", "shared", "benchmarks") for p in (ROOT / d).rglob("*.py"))


def _calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            yield node


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_unsafe_loading(path):
    for call in _calls(path):
        name = ast.unparse(call.func)
        keywords = {k.arg: k.value for k in call.keywords}
        if name == "torch.load":
            value = keywords.get("weights_only")
            assert isinstance(value, ast.Constant) and value.value is True, (
                f"{path.name}:{call.lineno}: {name}(...) without weights_only=True")
        remote = keywords.get("trust_remote_code")
        assert not (isinstance(remote, ast.Constant) and remote.value is True), (
            f"{path.name}:{call.lineno}: trust_remote_code=True hard-coded; pass args.trust_remote_code")
        if name.endswith("save_pretrained"):
            safe = keywords.get("safe_serialization")
            assert not (isinstance(safe, ast.Constant) and safe.value is False), f"{path.name}:{call.lineno}"


def test_the_scan_sees_the_sources():
    assert len(SOURCES) > 20 and any(p.name == "baseline.py" for p in SOURCES)
