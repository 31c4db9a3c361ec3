"""Serving doors other than JetStream's gRPC: an OpenAI-compatible HTTP server
(``serve.openai``) over the same engine and driver, its request rules (``serve.chat``) and a
small client (``serve.client``) that ``tppo generate`` uses."""
