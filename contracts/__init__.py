"""toolgate's contracts: the only code every service shares.

Wire messages are msgspec Structs (`calls`, `events`); subjects are constants
beside them (`subjects`); the tool registry is pydantic (`registry`).
"""
