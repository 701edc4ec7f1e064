"""Runnable examples, shipped as package data: `toolgate example NAME DIR` copies one out.

Each example is a package of its own: tool YAML files (with the Python
function they name, importable from the installed package) and the policies
of `toolgate.infra.policies/examples/` it adds to the default bundle.
"""
