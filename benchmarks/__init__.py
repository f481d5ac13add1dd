"""The measurements behind docs/results/, run from the repository's root as modules (``python -m benchmarks.<name>``),
which import each other and the checkout's packages with nothing set by hand. Never shipped: pyproject.toml's package
discovery names only the library's and the service's packages."""
