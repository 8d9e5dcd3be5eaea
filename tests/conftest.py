"""Shared test setup: make tests/ importable (peft_factory) and point caches at a temp dir."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
