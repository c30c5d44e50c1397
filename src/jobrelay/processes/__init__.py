"""The processes' entry points behind the CLI, and the API's HTTP server: the top layer."""
