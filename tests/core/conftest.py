from __future__ import annotations

import pytest
from peft_factory import ALL_LINEAR, save_peft_adapter, tiny_llama


@pytest.fixture(scope="session")
def peft_root(tmp_path_factory):
    """A registry root with real PEFT adapters of several shapes."""
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("adapters")
    model = tiny_llama()
    save_peft_adapter(model, root / "code-python-v2", r=8)
    save_peft_adapter(model, root / "med-qa-v1", r=4, rank_pattern={"q_proj": 16}, alpha_pattern={"v_proj": 4})
    save_peft_adapter(model, root / "legal-compliance-v1", r=16, target_modules=ALL_LINEAR, use_rslora=True)
    return root
