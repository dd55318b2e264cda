"""``loraplex batch``: offline generation over a JSONL file, in loraplex's own line format or OpenAI's batch format.

An application beside the server (``loraplex serve``), not a part of the engine: it runs lines through the offline
``LLM`` of loraplex.engine. The engine never imports this package.
"""
