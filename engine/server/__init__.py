"""The OpenAI-compatible server, above the engine (as vLLM's ``entrypoints/openai``).

- ``protocol.py``  request and response shapes (pydantic), the OpenAI error shape
- ``backend.py``   tenants from API keys, the cluster file, and the engine or cluster it builds
- ``loop.py``      the engine stepping on its own thread; asyncio handlers reach it through one queue
- ``remote.py``    ``kvledger serve``'s engine process: the same loop, reached over ZMQ
- ``metrics.py``   Prometheus metrics (``/metrics``)
- ``app.py``       the FastAPI app and its routes; ``serve`` runs it under uvicorn

The engine never imports the server.
"""
