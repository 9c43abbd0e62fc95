"""CPU reference engine: an HTTP server speaking the SGLang 0.5.23 protocol subset over transformers."""
