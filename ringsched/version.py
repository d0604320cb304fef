"""ringsched's version: what `pip show ringsched` says, and what nodes compare before they join one ring."""

__version__ = "0.1.0"
