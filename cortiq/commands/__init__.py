"""One module per CLI command (see cortiq/cli.py for the contract)."""
