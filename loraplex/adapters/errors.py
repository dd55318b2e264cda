"""The one error a bad adapter raises: a ValueError that names the file, the tensor and the limit."""

from __future__ import annotations


class AdapterError(ValueError):
    """A user-caused adapter problem (never a server fault). ``field`` names the config key at fault."""

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None,
                 field: str | None = None, limit: object = None) -> None:
        parts = [message]
        if file:
            parts.append(f"file: {file}")
        if tensor:
            parts.append(f"tensor: {tensor}")
        if limit is not None:
            parts.append(f"limit: {limit}")
        super().__init__(" | ".join(parts) if len(parts) > 1 else message)
        self.reason = message
        self.file = file
        self.tensor = tensor
        self.field = field
        self.limit = limit
