"""Speculative decoding (SPEC X1-X3): drafts are more tokens for ``num_computed_tokens`` to catch
up with (DESIGN §2). A proposer drafts after each step, the scheduler schedules the drafts with
the request's new token, the runner verifies them in the same forward with the platform's
rejection sampler, and the scheduler rolls ``num_computed_tokens`` back by the rejected ones."""

from octavo.spec_decode.config import SpeculativeConfig
from octavo.spec_decode.stats import SpecDecodeStats

__all__ = ["SpeculativeConfig", "SpecDecodeStats"]
