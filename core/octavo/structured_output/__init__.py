"""Structured output (SPEC G1-G3): a request's tokens constrained to a JSON schema, a regex, a
choice, a grammar or a structural tag, with xgrammar. The input processor compiles the grammar
(so a bad one is refused before the engine sees it); the runner's ``GrammarBitmask`` logits
processor masks each constrained row with the platform's bitmask kernel and advances the
request's matcher on the tokens it emits."""

from octavo.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
