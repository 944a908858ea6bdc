"""Prometheus metrics of the api service: what ingestion stored, and the REST requests served."""

from prometheus_client import Counter, Histogram

INGESTED = Counter(
    "crucible_api_ingested_total", "Stream messages written to the run history, by stream", ["stream"]
)
HTTP_REQUESTS = Counter(
    "crucible_api_http_requests_total",
    "REST requests, by method, route and status",
    ["method", "route", "status"],
)
HTTP_SECONDS = Histogram(
    "crucible_api_http_request_seconds",
    "Time to answer a REST request, by route",
    ["route"],
    buckets=(0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
)
