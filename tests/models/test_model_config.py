"""ModelConfig's checks: a file whose settings cannot run is refused at load with what is wrong, not later in a
kernel."""

from __future__ import annotations

import math

import pytest

from tokenriver.errors import ModelLoadError
from tokenriver.models.config import ModelConfig

SIZES = dict(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
)


@pytest.mark.parametrize("name", ["attn_logit_softcapping", "final_logit_softcapping"])
@pytest.mark.parametrize("cap", [-5.0, math.inf, math.nan])
def test_a_soft_cap_must_be_positive_and_finite(name, cap):
    with pytest.raises(ModelLoadError, match=f"{name}=.* must be a positive finite number"):
        ModelConfig(architecture="gemma2", **SIZES, **{name: cap})


def test_gemma2_caps_are_accepted():
    config = ModelConfig(architecture="gemma2", **SIZES, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    assert config.attn_logit_softcapping == 50.0
