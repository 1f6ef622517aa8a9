"""Device-agnostic blocks: float work in torch, weight-bound ops through the backend."""
