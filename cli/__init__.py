"""The `toolgate` command line: thin commands over the services, client and stack."""
