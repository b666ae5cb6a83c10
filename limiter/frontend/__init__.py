"""The stateless OpenAI-compatible HTTP frontend (``qos frontend``).

All shared state lives in Redis; any number of these processes run behind a load
balancer. Modules: settings (the ``[frontend]`` table), auth (API key -> tenant and
class), openai_api (request validation and response shapes), errors (HTTP errors and the
middleware that maps every exception to one), replies (the per-pool reply-stream reader
and heartbeat), runtime (the process's Redis client, loops and shutdown), generation (one
request's admission, wait and answer), metrics, app (routes and ``create_app``), cli
(``qos frontend``).
"""
