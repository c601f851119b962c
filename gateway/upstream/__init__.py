"""The upstream hop: replicas and their pools, attempts, retries, failures, the relay, HTTP/1.1."""
