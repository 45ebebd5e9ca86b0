"""User entry points: the offline ``LLM`` class (``llm``, with beam search in ``beam_search``) and
the OpenAI-compatible HTTP server (``openai``)."""
