"""The weights' owner: where each weight lives (memory, a shared file, a mapped file) and copies."""
