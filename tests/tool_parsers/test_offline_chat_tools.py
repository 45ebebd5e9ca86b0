"""``LLM.chat(..., tools=...)``: the tools reach the chat template offline as over HTTP."""

from __future__ import annotations

from pathlib import Path

import pytest

import octavo
from octavo import LLM, SamplingParams

DEMO_MODEL = Path(octavo.__file__).resolve().parent / "data" / "demo-model"
TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


def test_llm_chat_shows_the_tools_to_the_template():
    if not (DEMO_MODEL / "config.json").is_file():
        pytest.skip("the bundled demo model is not present")
    llm = LLM(str(DEMO_MODEL), kv_cache_memory="16MiB")
    messages = [{"role": "user", "content": "add 5 and 6"}]
    params = SamplingParams(max_tokens=1)
    (with_tools,) = llm.chat(messages, params, tools=[TOOL], use_tqdm=False)
    (without,) = llm.chat(messages, params, use_tqdm=False)
    text = llm.get_tokenizer().decode(with_tools.prompt_token_ids)
    assert '<tools>\n{"type": "function", "function": {"name": "add"' in text
    assert len(with_tools.prompt_token_ids) > len(without.prompt_token_ids)
