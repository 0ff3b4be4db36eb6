from __future__ import annotations

from pathlib import Path

import pytest
from goldens import GOLDEN


@pytest.fixture
def trained_path() -> Path:
    return GOLDEN / "trained_with_optimizer.ckpt"
