"""User entry points: the offline ``LLM`` class (and later the server)."""
