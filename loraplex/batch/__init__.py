"""``loraplex batch``: offline generation over a JSONL file, in loraplex's own line format or OpenAI's batch format.

An application beside the server (``loraplex serve``), not a part of the engine: it runs lines through the offline
``LLM`` of loraplex.engine, and reads OpenAI-format bodies with the server's own request mapping
(loraplex.platform.inference.plan), so one body gets one answer from both. The engine never imports this package
(DESIGN.md: engine, adapters and kernels never import platform).
"""
