"""Serving over HTTP: the OpenAI-compatible server (server.py) and the streaming client that
bench.py --backend openai drives any such server with (client.py)."""
