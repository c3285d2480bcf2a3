"""The edge role: OpenAI-compatible HTTP API and the IOP listener nodes dial."""
