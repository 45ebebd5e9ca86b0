"""The server takes request defaults from a generation config (vLLM's --generation-config)."""

from __future__ import annotations

import json

from server_constants import MODEL_NAME

from octavo import SamplingParams

PROMPT = "once upon a time there was a little girl"


def test_unset_fields_take_the_generation_configs_values(server_factory, offline, tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"top_k": 1, "temperature": 0.9, "max_new_tokens": 5})
    )
    server = server_factory(generation_config=str(tmp_path))
    client = server.client()
    (greedy,) = offline.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False
    )

    # top_k=1 from the file makes the request greedy; max_new_tokens caps the OpenAI default of 16.
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT)
    assert response.choices[0].text == greedy.outputs[0].text
    assert response.usage.completion_tokens == 5 and response.choices[0].finish_reason == "length"
    # A smaller request limit stands; a request's own top_k wins over the file's.
    short = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0)
    assert short.usage.completion_tokens == 3
    sampled = [
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, seed=seed, extra_body={"top_k": 0}
        )
        .choices[0]
        .text
        for seed in range(4)
    ]
    assert len(set(sampled)) > 1, "with top_k=0 in the request, temperature 0.9 should sample"
    # Chat without a limit gets the cap too.
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hello"}]
    )
    assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"
