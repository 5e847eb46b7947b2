"""pipetorch's version, as pyproject.toml gives it: compiled caches and saved artefacts record it."""
__version__ = "0.1.0"
