"""Adapter registry: tenants upload PEFT LoRA adapters, validated with the engine's own validator, stored
content-addressed, versioned, shared, and resolved from a request's ``model`` name."""
