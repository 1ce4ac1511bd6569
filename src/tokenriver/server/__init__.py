"""The OpenAI-compatible HTTP server over AsyncEngine.

protocol.py   pydantic request/response models (strict, closed)
serving.py    requests → prompt ids + SamplingParams; RequestOutputs → responses and stream chunks
app.py        build_app(engine, config): routes, middleware, errors → OpenAI's shape
metrics.py    Prometheus metrics, one registry per app
serve.py      run_server: load, bind, uvicorn, graceful SIGTERM
cli_serve.py  add_serve_command: `tokenriver serve` and `tokenriver visualize`
config.py     ServerConfig
"""
