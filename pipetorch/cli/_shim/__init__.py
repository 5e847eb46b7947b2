"""The `poptorch` and `popdist` shims: on PYTHONPATH for `pipetorch run`'s child interpreters."""
