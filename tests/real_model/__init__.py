"""A real inference server for tests: llama.cpp's own server (xllamacpp) with SmolLM2-135M."""
