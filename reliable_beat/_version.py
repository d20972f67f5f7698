"""The package version, importable without importing the package root (the CLI does)."""

__version__ = "0.1.0"
