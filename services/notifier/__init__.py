"""The notifier service: approval notifications to webhooks (see app.py)."""
