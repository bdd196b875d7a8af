"""The OpenAI-compatible HTTP server: FastAPI app (app.py), request/response models (protocol.py),
OpenAI-shaped errors (errors.py), handlers (openai_serving.py, native.py), auth and size limits
(auth.py), Prometheus metrics (metrics.py) and the process entry point (launch.py)."""
