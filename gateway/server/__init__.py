"""The server: the app and its wiring, middlewares, handlers, the process's life, workers, the CLI."""
