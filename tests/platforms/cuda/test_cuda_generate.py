"""End to end on the cuda platform (the interpreter here): the greedy tokens of the cpu platform."""

from __future__ import annotations

import pytest


@pytest.mark.needs_kernels
@pytest.mark.slow
def test_greedy_generation_matches_the_cpu_platform(platform, greedy_tokens):
    assert greedy_tokens("cuda") == greedy_tokens("cpu")
