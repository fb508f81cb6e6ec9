"""The package version, in a module of its own: base modules (``envinfo``) and the
observe layer (profiles) read it without importing the package's ``__init__``."""

__version__ = "0.1.0"
