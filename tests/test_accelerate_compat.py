"""Accelerate's internals are read in shared/core/accelerate_compat.py only, each checked under another version."""

import types

import accelerate
import pytest

from shared.core import accelerate_compat as compat
from shared.core.errors import LaunchError


def test_another_version_without_the_attribute_is_refused_naming_it(monkeypatch):
    held = types.SimpleNamespace(_models=["m"], _schedulers=[], native_amp=False, scaler=None)
    assert compat.prepared_models(held) == ["m"]  # the pinned version: used as it is
    monkeypatch.setattr(accelerate, "__version__", "9.0.0")
    assert compat.prepared_models(held) == ["m"] and compat.prepared_schedulers(held) == []  # still there: used
    with pytest.raises(LaunchError, match=r"Accelerator\._models .* pip install accelerate==1\.15\.0"):
        compat.prepared_models(types.SimpleNamespace())
    with pytest.raises(LaunchError, match=r"Accelerator\.native_amp"):
        compat.enable_cpu_fp16(types.SimpleNamespace(scaler=None), scaler=None)
    assert compat.available_trackers() is not None  # the public function
