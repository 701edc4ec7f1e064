"""Cedar policy bundles (default/) and examples (examples/), shipped as package data."""
