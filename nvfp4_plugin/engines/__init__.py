"""Thin engine adapters: the only code that imports vLLM or SGLang."""
