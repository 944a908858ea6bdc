"""Serving a model over the OpenAI API: the sampling engine on the continuous batcher (engine), the
request bodies (protocol) and the HTTP routes (app). `crucible serve` runs it standalone."""
