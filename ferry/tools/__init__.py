"""User-facing tools built on the engine: info, bench, sweep, ppl, compare."""
