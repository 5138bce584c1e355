"""What every Ballast process shows Prometheus: the metric families (`families`), and the
one /metrics text each process serves (`exposition`): Ballast's own series, the series of
the libraries in the process that register with prometheus_client (vLLM's, on an engine
worker), and the Temporal SDK's, read from its runtime's own endpoint."""
