"""Model calls: retries, the adaptive limiter, the HTTP transport."""
