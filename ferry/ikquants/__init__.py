"""ik_llama.cpp's quant forms that need more than a table row to read: its interleaved (_R4 / _R8 / _R16) layouts,
undone into the plain types' rows, and its trellis types' generated values. numpy only, below ferry.quant (which
calls them) and above nothing of ferry's but its errors."""
