"""The stateless OpenAI-compatible HTTP frontend (``qos frontend``).

All shared state lives in Redis; any number of these processes run behind a load
balancer. Modules: settings (the ``[frontend]`` table), auth (API key -> tenant and
class), openai_api (request validation, response shapes, HTTP errors), replies (the
per-pool reply-stream reader and heartbeat), metrics, app (routes and request path),
cli (``qos frontend``).
"""
