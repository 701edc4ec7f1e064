"""ClickHouse DDL shipped as package data (the files beside this one)."""
