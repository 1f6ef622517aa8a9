"""User-facing tools built on the engine: info, and later bench, sweep, ppl, compare."""
