"""NATS roles and permissions (permissions.yaml), shipped as package data."""
