"""The engines: ``EngineCore`` (schedule -> execute -> update on one platform), ``LLMEngine`` (the
core plus the input and output sides, driven by ``step()``) and ``AsyncEngine`` (an LLMEngine on a
thread of its own, for asyncio servers). Import them from their modules."""
