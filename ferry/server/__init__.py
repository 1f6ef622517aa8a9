"""The OpenAI-compatible HTTP server: the slot scheduler and the FastAPI app."""
