"""`python -m pipeline.serve`: an OpenAI-compatible HTTP server over a build, on the C++ batched engine.

    python -m pipeline.serve                          # the default recipe's latest off-graph build, 127.0.0.1:8000
    python -m pipeline.serve --run outputs/runs/<time> --port 8080

The layout: engine.py drives `llm_batched_runner --serve` (requests join its running batch between steps, the prefix
cache is shared, a client that goes away cancels its request); openai_api.py reads and checks the request bodies;
generation.py turns one choice into text (detokenizing, stop strings, the grammar of response_format and tools);
tool_calls.py knows the chat templates' tool-call formats; app.py is the ASGI application (Starlette on uvicorn) with
its queue, metrics and errors; __main__.py finds the build and starts it all.
"""
